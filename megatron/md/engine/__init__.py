"""The MD step as a multi-tensor engine: every matrix an optimizer holds stepped by a fixed
number of batched operations (``engine.py``; the gains' Adam ``gainstep.py``), the base
optimizer behind one interface (``basesteps.py``), compiled kernels (``compiled.py``: their
formulas ``formulas.py``, their first-call check ``checked.py``)."""

"""The MD versions of megatron-core's optimizer wrappers, and walking megatron's optimizer tree.

``enable_md`` retargets each leaf optimizer's class to its MD subclass (``MDDistributedOptimizer``
in zero1.py, ``MDFloat16OptimizerWithFloat16Params`` and ``MDFP32Optimizer`` in whole.py, built
from the methods below): megatron's behaviour everywhere, plus MD state in its checkpoints
(``checkpoint.py``) and the bookkeeping of which loads gave it state.
"""

from __future__ import annotations

import torch

from megatron.md.checkpoint import load_md, md_entry
from megatron.md.leaves import is_md_wrapper, leaf_optimizers


def begin_model_load(optimizer) -> None:
    """Before megatron loads a checkpoint: no MD wrapper has received state yet."""
    for opt in leaf_optimizers(optimizer):
        if is_md_wrapper(opt):
            opt.md_state_loaded = False


def finish_model_load(optimizer) -> int:
    """After megatron loaded a checkpoint: an MD wrapper that received neither optimizer state
    nor ``reload_model_params`` (``--finetune`` / ``--no-load-optim`` with fp32 params:
    megatron reloads main params only for fp16/bf16, training/checkpointing.py, load_checkpoint)
    still holds MD state made from the weights *before* the load, and its first step would write
    them back over the loaded ones. Recreate it from the loaded weights; returns how many were."""
    n = 0
    for opt in leaf_optimizers(optimizer):
        if is_md_wrapper(opt) and not opt.md_state_loaded:
            opt.optimizer.reinit_from_weights()
            opt.md_state_loaded = True
            n += 1
    return n


def _load_fixed(base_cls, self, state_dict, fix_step: bool) -> None:
    """megatron's load under no_grad, then one step tensor per param (``_md_fix_step`` below)."""
    step = state_dict["optimizer"]["param_groups"][0].get("step") if fix_step else None
    # fp32 main params are views of leaf params (megatron's
    # DistributedOptimizer._set_main_param_and_optimizer_states)
    with torch.no_grad():
        base_cls.load_state_dict(self, state_dict)
    if step is not None:
        for st in self.optimizer.state.values():
            st["step"] = torch.tensor(float(step))


def set_states_without_step(base_cls, self, model_param, tensors: dict) -> None:
    """megatron's ``_set_main_param_and_optimizer_states`` for a fully-reshardable load
    (``--dist-ckpt-optim-fully-reshardable``): that load leaves out torch Adam's "step"
    (distrib_optimizer.py:2392, ``load_parameter_state_from_fully_reshardable``) and the method
    then reads every tensor of the param's state from it (:1223) — torch's Adam and MD's inner
    optimizer keep the step as a tensor there: a KeyError at every resume. A missing step is
    skipped as megatron skips a non-tensor; the step is restored after the load
    (``_load_fixed``)."""
    base_cls._set_main_param_and_optimizer_states(self, model_param, {"step": None, **tensors})


def fix_plain_resume(optimizer) -> None:
    """Resume of megatron's own (non-MD) DistributedOptimizer without TE/Apex, the four
    upstream bugs worked around here in one place: the load template needs torch AdamW state
    before the first step (``DistributedOptimizer.state_dict`` asserts one step value), the
    load writes into views of leaf params (``_set_main_param_and_optimizer_states``, needs
    no_grad), every param ends up sharing ONE step tensor, advanced N times per step
    (``load_state_dict``, ``_set_main_param_and_optimizer_states``), and a fully-reshardable
    load has no step for that tensor (``set_states_without_step``)."""
    from megatron.core.optimizer import distrib_optimizer as dopt

    if dopt.HAVE_APEX_OR_TE:
        return
    for o in leaf_optimizers(optimizer):
        if not isinstance(o, dopt.DistributedOptimizer) or is_md_wrapper(o):
            continue
        if not isinstance(o.optimizer, torch.optim.AdamW | torch.optim.Adam):
            continue
        for group in o.optimizer.param_groups:
            for p in group["params"]:
                if not o.optimizer.state[p]:  # what torch creates lazily at the first step
                    o.optimizer.state[p] = {
                        "step": torch.tensor(0.0),
                        "exp_avg": torch.zeros_like(p),
                        "exp_avg_sq": torch.zeros_like(p),
                    }
        base = type(o)

        def load_state_dict(self, state_dict, _base=base):
            _load_fixed(_base, self, state_dict, fix_step=True)

        def set_states(self, model_param, tensors, _base=base):
            set_states_without_step(_base, self, model_param, tensors)

        methods = {"load_state_dict": load_state_dict,
                   "_set_main_param_and_optimizer_states": set_states}  # fmt: skip
        o.__class__ = type(f"Resumable{base.__name__}", (base,), methods)


# ---- the MD wrapper classes' shared methods ----
# Each MD wrapper is a plain subclass of ONE megatron class, written out where its integration
# lives (zero1.MDDistributedOptimizer, whole.MDFloat16OptimizerWithFloat16Params and
# whole.MDFP32Optimizer, each under ``@md_wrapper``) and set as the leaf's ``__class__`` by
# ``enable_md``. No mixin: CPython refuses ``__class__`` retargeting to a class with a second
# base (megatron's wrappers have an ABC layout), and megatron builds its wrappers with no hook.
# The methods below read two class attributes: ``_md_base`` (the megatron class) and
# ``_md_fix_step`` (DistributedOptimizer without TE/Apex aliases ONE step tensor to every
# param on load and dp_reshardable copies the pre-load step into it: megatron's
# DistributedOptimizer.load_state_dict and _set_main_param_and_optimizer_states; the
# checkpoint's step is restored afterwards).


def md_sharded_state_dict(self, model_sharded_state_dict, is_loading=False, **kwargs):
    """megatron's sharded state dict plus ``["md"]``: the MD config and state
    (checkpoint.md_entry); when loading a checkpoint without MD state, the config only."""
    sd = self._md_base.sharded_state_dict(self, model_sharded_state_dict, is_loading, **kwargs)
    entry = md_entry(self, model_sharded_state_dict)
    if is_loading and not self.md_expect_state:
        entry.pop("state")
    sd["md"] = entry
    return sd


def md_load_state_dict(self, state_dict) -> None:
    """megatron's load, then the MD state (or MD state made from the loaded weights)."""
    md = state_dict.pop("md", None)
    _load_fixed(self._md_base, self, state_dict, self._md_fix_step)
    load_md(self, md)
    self.optimizer.rebind()  # what the load replaced, into the engine's storage again
    self.md_state_loaded = True


def md_reload_model_params(self, state_dict=None) -> None:
    """megatron's reload of main params from the model, then MD state made from them."""
    self._md_base.reload_model_params(self, state_dict)
    self.optimizer.reinit_from_weights()
    self.md_state_loaded = True


def md_grads_for_grad_norm(self, grad_norm_group=None) -> list:
    """megatron's gradients for the norm, plus MD's probe in the main norm: 0 while MD's state
    is finite, NaN once not, so megatron's norm reduction carries the flag to the host
    (train/nonfinite.py) with no synchronization of MD's own."""
    grads = self._md_base.get_grads_for_grad_norm(self, grad_norm_group)
    engine = self.optimizer.engine
    if grad_norm_group is None and engine is not None and engine.watches:
        probe = self.optimizer.probe
        probe.md_probe_of = self
        grads = [*grads, probe]
    return grads


def md_wrapper(cls):
    """Class decorator of an MD wrapper class (one megatron base class, nothing else): adds
    the shared methods above and the attributes ``enable_md`` and the loads read."""
    (base,) = cls.__bases__
    cls._md_wrapper, cls._md_base = True, base
    cls._md_fix_step = cls.__dict__.get("_md_fix_step", False)
    cls.md_expect_state = True  # whether the checkpoint being loaded has MD state
    cls.md_state_loaded = True  # whether the last load gave this optimizer state
    cls.md_flat_direction = False  # the loaded checkpoint keeps the earlier 1-D fp32 direction
    cls.sharded_state_dict = md_sharded_state_dict
    cls.load_state_dict = md_load_state_dict
    cls.reload_model_params = md_reload_model_params
    cls.get_grads_for_grad_norm = md_grads_for_grad_norm
    return cls

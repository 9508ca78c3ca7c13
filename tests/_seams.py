"""Save and restore what compat.SEAMS replaces, for tests that apply seams in the test process."""


def saved_seams():
    """Every attribute compat.SEAMS replaces, as (holder, name, value or None if the holder
    did not define it itself); ``restore_seams`` puts them back, so a test that applies seams
    leaves megatron as the other tests of this process see it."""
    from megatron.md import compat

    return [(h, n, vars(h).get(n)) for h, n in (compat.owner(s) for s in compat.SEAMS if s.replace)]


def restore_seams(saved) -> None:
    for holder, name, value in saved:
        if value is not None:
            setattr(holder, name, value)
        elif name in vars(holder):  # a method the seam set on a class that inherited it
            delattr(holder, name)

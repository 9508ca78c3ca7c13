"""megatron/md/train/forked.py: a branch from another run's checkpoint (``--load A --save B``)
is started once; its requeued attempts continue in B. The real runs: test_pretrain_e2e.py."""

from argparse import Namespace

import pytest

from megatron.md import errors
from megatron.md.train import args as md_args
from megatron.md.train import forked


def run(load, save, ckpt_step=None) -> Namespace:
    return Namespace(load=str(load), save=str(save), ckpt_step=ckpt_step,
                     pretrained_checkpoint=None, init_from=None)  # fmt: skip


@pytest.fixture
def branch(tmp_path, monkeypatch):
    """Run A (iteration 10) and this job's branch B, which has saved 12; no restart count."""
    for k in ("SLURM_RESTART_COUNT", "TORCHELASTIC_RESTART_COUNT"):
        monkeypatch.delenv(k, raising=False)
    for d, it in (("A", "10"), ("B", "12")):
        (tmp_path / d).mkdir()
        (tmp_path / d / "latest_checkpointed_iteration.txt").write_text(it)
    return tmp_path / "A", tmp_path / "B"


def test_a_requeued_attempt_continues_in_its_own_save(branch, monkeypatch):
    a, b = branch
    for k in ("SLURM_RESTART_COUNT", "TORCHELASTIC_RESTART_COUNT"):
        monkeypatch.setenv(k, "1")
        args = run(a, b, ckpt_step=10)  # A's iteration: not B's
        md_args.check_run_dirs(args)  # not refused
        line = forked.settle(args)
        assert (args.load, args.ckpt_step) == (str(b), None)
        assert line == (f"requeued: continuing from iteration 12 in --save, saved by this job "
                        f"after it started from --load {a} (another run's --load starts the "
                        "job's first attempt only)")  # fmt: skip
        monkeypatch.delenv(k)


def test_the_job_submitted_again_by_hand_is_still_refused(branch):
    a, b = branch
    args = run(a, b)
    assert forked.settle(args) is None and args.load == str(a)
    with pytest.raises(errors.Refusal, match=f"--save {b} holds another run's checkpoints .* "
                       f"Resume that run with --load {b}"):  # fmt: skip
        md_args.check_run_dirs(args)


def test_what_is_left_as_given(branch, monkeypatch, tmp_path):
    a, b = branch
    monkeypatch.setenv("SLURM_RESTART_COUNT", "1")
    new = tmp_path / "new"  # the first attempt stopped before its first save: A again
    for args in (run(a, new), run(b, b), run(a, a)):
        was = (args.load, args.ckpt_step)
        assert forked.settle(args) is None and (args.load, args.ckpt_step) == was

"""megatron/md/train/rewind.py: ``--ckpt-step`` in a run's own ``--save`` rewinds once. The
real runs (a rewind, then its requeue with the same flags): test_pretrain_e2e.py."""

import json
import os
from argparse import Namespace

import pytest

from megatron.md import errors
from megatron.md.train import rewind


def run(d, step, load=None) -> Namespace:
    return Namespace(save=str(d), load=str(load or d), ckpt_step=step)


def test_a_requeued_attempt_continues_from_what_the_job_saved_since(tmp_path, monkeypatch):
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("15")
    monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT", raising=False)
    monkeypatch.setenv("SLURM_RESTART_COUNT", "1")
    args = run(tmp_path, 10)
    line = rewind.settle(args)
    assert args.ckpt_step is None and line.startswith("requeued: continuing from iteration 15")
    for step, restarts in ((15, "1"), (20, "1"), (10, "0"), (10, "")):  # nothing saved since, or
        monkeypatch.setenv("SLURM_RESTART_COUNT", restarts)  # the job's first attempt
        args = run(tmp_path, step)
        assert rewind.settle(args) is None and args.ckpt_step == step
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")  # torchrun restarted the ranks
    args = run(tmp_path, 10)
    assert rewind.settle(args) is not None and args.ckpt_step is None
    monkeypatch.setenv("SLURM_RESTART_COUNT", "2")
    other = tmp_path / "other"  # another run's directory: its tracker is not this job's
    other.mkdir()
    args = run(other, 10, load=tmp_path)
    assert rewind.settle(args) is None and args.ckpt_step == 10


def test_the_tracker_names_the_checkpoint_a_rewind_loaded(tmp_path):
    tracker = tmp_path / "latest_checkpointed_iteration.txt"
    tracker.write_text("20")
    assert rewind.mark(run(tmp_path, 10), rank=1) is None and tracker.read_text() == "20"
    line = rewind.mark(run(tmp_path, 10), rank=0)
    assert tracker.read_text() == "10" and "(it named 20)" in line
    assert rewind.mark(run(tmp_path, 10), rank=0) is None  # already so
    assert rewind.mark(run(tmp_path, None), rank=0) is None
    other = tmp_path / "other"
    other.mkdir()
    assert rewind.mark(run(other, 4, load=tmp_path), rank=0) is None  # --load's is not touched
    assert tracker.read_text() == "10" and not (other / tracker.name).exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest_checkpointed_iteration.txt",
                                                          "md_rewind.json", "other"]  # fmt: skip
    note = json.loads((tmp_path / "md_rewind.json").read_text())
    assert (note["iteration"], note["from"]) == (10, 20) and note["time"].startswith("20")


def test_a_first_attempt_that_would_make_the_last_rewind_again_is_refused(tmp_path, monkeypatch):
    """A job submitted again by hand with its script's ``--ckpt-step 10`` (no restart count),
    after the run was rewound to 10 and has saved 15 since: refused, naming both ways out; the
    requeue of the same job continues; a rewind to another iteration, one with nothing saved
    since, and one whose note was deleted go on."""
    for k in ("SLURM_RESTART_COUNT", "TORCHELASTIC_RESTART_COUNT"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    tracker = tmp_path / "latest_checkpointed_iteration.txt"
    tracker.write_text("20")
    assert rewind.settle(run(tmp_path, 10)) is None  # the first rewind: no note yet
    rewind.mark(run(tmp_path, 10), rank=0)
    tracker.write_text("15")  # the rewound run saved 15
    with pytest.raises(errors.Refusal) as e:
        rewind.settle(run(tmp_path, 10))
    assert e.value.msg.startswith(f"--ckpt-step 10: {tmp_path} was rewound to iteration 10 "
                                  "already (20")  # fmt: skip
    assert e.value.msg.endswith(
        ", job 4242) and has saved up to iteration 15 since, which this launch would train over: "
        f"drop --ckpt-step to continue from 15, or delete {tmp_path}/md_rewind.json to rewind "
        "to 10 again"
    )  # fmt: skip
    for step in (5, 15, 20):  # another rewind, nothing saved since, a jump ahead
        args = run(tmp_path, step)
        assert rewind.settle(args) is None and args.ckpt_step == step
    monkeypatch.setenv("SLURM_RESTART_COUNT", "1")
    assert rewind.settle(run(tmp_path, 10)).startswith("requeued: continuing from iteration 15")
    monkeypatch.setenv("SLURM_RESTART_COUNT", "0")
    (tmp_path / "md_rewind.json").unlink()
    args = run(tmp_path, 10)
    assert rewind.settle(args) is None and args.ckpt_step == 10


def test_megatrons_iteration_override_sets_a_run_back_once(tmp_path, monkeypatch):
    """``--override-ckpt-iteration 2`` (megatron sets the loaded checkpoint's iteration to 2 at
    every load): a checkpoint saved by a run given the same value is the job's own after it
    was set back, so the flag is dropped there, and kept in the args later checkpoints carry
    (a third attempt finds it); one saved without it, or with another value, gets it. The
    real runs: three attempts by hand, 2026-11-29 (iterations 3–8 once, losses equal to the
    run without a stop); the common state is megatron's (read here through a stand-in)."""
    from megatron.core import dist_checkpointing

    saved = {}
    monkeypatch.setattr(dist_checkpointing, "load_common_state_dict",
                        lambda path: {"args": saved[os.path.basename(path)]})  # fmt: skip
    for it in (6, 4, 8):
        (tmp_path / f"iter_{it:07d}").mkdir()
        (tmp_path / f"iter_{it:07d}" / ".metadata").touch()
    saved["iter_0000006"] = Namespace(override_ckpt_iteration=None)  # the run before
    saved["iter_0000004"] = Namespace(override_ckpt_iteration=2)  # saved after the override
    saved["iter_0000008"] = Namespace(override_ckpt_iteration=None, md_override_ckpt_iteration=2)

    def args(step=None, n=2):
        return Namespace(load=str(tmp_path), ckpt_step=step, override_ckpt_iteration=n)

    for step, n in ((6, 2), (4, 3), (8, 5)):  # before the override; another value
        a = args(step, n)
        assert rewind.settle_override(a) is None and a.override_ckpt_iteration == n
    for step in (4, 8):
        a = args(step)
        line = rewind.settle_override(a)
        assert a.override_ckpt_iteration is None and a.md_override_ckpt_iteration == 2
        assert line == (
            f"continuing from iteration {step}, saved after --override-ckpt-iteration "
            "2 set the run back (it applies to a checkpoint saved without it only)"
        )
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("8")
    assert rewind.settle_override(args()) is not None  # the tracker's
    a = args(n=None)
    assert rewind.settle_override(a) is None and not hasattr(a, "md_override_ckpt_iteration")

"""megatron/md/train/rewind.py: ``--ckpt-step`` in a run's own ``--save`` rewinds once. The
real runs (a rewind, then its requeue with the same flags): test_pretrain_e2e.py."""

import json
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

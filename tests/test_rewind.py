"""megatron/md/train/rewind.py: ``--ckpt-step`` in a run's own ``--save`` rewinds once. The
real runs (a rewind, then its requeue with the same flags): test_pretrain_e2e.py."""

from argparse import Namespace

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
                                                          "other"]  # fmt: skip

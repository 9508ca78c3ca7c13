"""megatron/md/train/freshoptim.py: ``--no-load-optim`` in a run's own ``--save`` starts a
fresh optimizer once. The real runs (a fresh start, its requeue, the job again by hand):
test_pretrain_e2e.py."""

import json
from argparse import Namespace

import pytest

from megatron.md import errors
from megatron.md.train import freshoptim


def run(d, load=None, ckpt_step=None, **kw) -> Namespace:
    flags = dict(no_load_optim=True, finetune=False, no_save_optim=False)
    return Namespace(save=str(d), load=str(load or d), ckpt_step=ckpt_step, **{**flags, **kw})


@pytest.fixture
def started(tmp_path, monkeypatch):
    """A run directory whose fresh optimizer started at iteration 10 (job 4242) and that has
    saved 14 since; no restart count."""
    for k in ("SLURM_RESTART_COUNT", "TORCHELASTIC_RESTART_COUNT"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    tracker = tmp_path / "latest_checkpointed_iteration.txt"
    tracker.write_text("10")
    assert freshoptim.settle(run(tmp_path)) is None  # the first fresh start: no note yet
    freshoptim.mark(run(tmp_path), 10, rank=1)
    assert not (tmp_path / freshoptim.NOTE).exists()  # rank 0 writes it
    freshoptim.mark(run(tmp_path), 10, rank=0)
    note = json.loads((tmp_path / freshoptim.NOTE).read_text())
    assert (note["iteration"], note["job"]) == (10, "4242") and note["time"].startswith("20")
    tracker.write_text("14")
    return tmp_path


def test_a_requeued_attempt_loads_the_state_the_job_saved_since(started, monkeypatch):
    for k, v in (("SLURM_RESTART_COUNT", "1"), ("TORCHELASTIC_RESTART_COUNT", "1")):
        monkeypatch.setenv(k, v)
        args = run(started)
        line = freshoptim.settle(args)
        assert args.no_load_optim is False and line == (
            "requeued: iteration 14 was saved by this job after its fresh optimizer at 10: its "
            "optimizer state is loaded, the iteration goes on (--no-load-optim starts the job's "
            "first attempt only)"
        )
        monkeypatch.delenv(k)


def test_a_first_attempt_that_would_drop_it_again_is_refused(started):
    with pytest.raises(errors.Refusal) as e:
        freshoptim.settle(run(started))
    assert e.value.msg == (
        f"--no-load-optim: {started} started a fresh optimizer at iteration 10 already ("
        + json.loads((started / freshoptim.NOTE).read_text())["time"]
        + ", job 4242) and has saved its state up to iteration 14 since, which this launch "
        f"would drop: drop --no-load-optim to continue it, or delete {started}/"
        "md_fresh_optimizer.json to start a fresh optimizer again"
    )


@pytest.mark.parametrize(
    "why,kw",
    [
        ("nothing saved since", dict(ckpt_step=10)),
        ("a rewind before it", dict(ckpt_step=8)),
        ("what it saved holds no optimizer state", dict(no_save_optim=True)),
        ("the flag not given", dict(no_load_optim=False)),
    ],
)
def test_what_is_left_as_given(started, monkeypatch, why, kw):
    monkeypatch.setenv("SLURM_RESTART_COUNT", "1")
    args = run(started, **kw)
    assert freshoptim.settle(args) is None, why
    assert args.no_load_optim is kw.get("no_load_optim", True), why


@pytest.mark.parametrize("no_load_optim", [False, True])
@pytest.mark.parametrize("no_save_optim", [False, True])
def test_megatrons_finetune_restarts_the_first_attempt_only(
    started, monkeypatch, no_load_optim, no_save_optim
):
    """``--finetune`` (weights only, iteration 0) read again at a requeue restarted it at 0: it
    is dropped, and ``--no-load-optim`` with it unless the run saves no optimizer state."""
    with pytest.raises(errors.Refusal, match="--finetune: .* would drop \\(--finetune restarts"):
        freshoptim.settle(run(started, no_load_optim=False, finetune=True))  # by hand
    monkeypatch.setenv("SLURM_RESTART_COUNT", "1")
    args = run(started, no_load_optim=no_load_optim, finetune=True, no_save_optim=no_save_optim)
    line = freshoptim.settle(args)
    assert (args.finetune, args.no_load_optim) == (False, no_save_optim)
    flags = (
        "--no-load-optim and --finetune" if no_load_optim and not no_save_optim else "--finetune"
    )
    assert line.endswith(f"the iteration goes on ({flags} starts the job's first attempt only)")


def test_another_runs_checkpoint_and_a_deleted_note_are_left_alone(started, tmp_path):
    other = tmp_path / "other"
    other.mkdir()
    args = run(other, load=started)  # a branch of another run: its state is not this job's
    assert freshoptim.settle(args) is None and args.no_load_optim
    freshoptim.mark(args, 14, rank=0)  # the branch's note, in its own --save (forked.py)
    assert json.loads((other / freshoptim.NOTE).read_text())["iteration"] == 14
    (started / freshoptim.NOTE).unlink()
    args = run(started)
    assert freshoptim.settle(args) is None and args.no_load_optim

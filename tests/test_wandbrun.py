"""Which wandb run a launch continues (megatron/md/train/wandbrun.py): the one that saved the
checkpoint it resumes, unless that run went on past it (a rewind) or the launch resumes nothing
of its own. The real wandb run continued across two launches: test_pretrain_e2e.py."""

import argparse
import json
import os

import pytest

from megatron.md.train import wandbrun


def run_dir(tmp_path, tracker=None, saves=None, last=None, name="run"):
    save = tmp_path / name
    save.mkdir()
    if tracker is not None:
        (save / "latest_checkpointed_iteration.txt").write_text(f"{tracker}\n")
    if saves is not None:
        (save / wandbrun.FILE).write_text(json.dumps({"saves": saves, "last": last}))
    return save


def parse(flags):
    """The parsed flags wandbrun reads (megatron's names and types)."""
    p = argparse.ArgumentParser()
    for flag in ("--wandb-project", "--save", "--load"):
        p.add_argument(flag)
    p.add_argument("--ckpt-step", type=int)
    p.add_argument("--finetune", action="store_true")
    return p.parse_args(flags)


def run_args(save, *extra, load=None):
    return parse(["--wandb-project=p", f"--save={save}", f"--load={load or save}", *extra])


def test_a_first_start_and_a_resume_of_another_directory_open_a_new_run(tmp_path):
    save = run_dir(tmp_path)
    assert wandbrun.choose(run_args(save)) == (
        None, "a new wandb run (this run resumes no checkpoint of its --save)")  # fmt: skip
    other = run_dir(tmp_path, tracker=4, saves={"4": "a"}, last={"a": 4}, name="other")
    assert wandbrun.choose(run_args(save, load=other))[0] is None  # another run's checkpoint
    assert wandbrun.choose(run_args(other))[0] == "a"
    assert wandbrun.choose(run_args(other, "--finetune"))[0] is None  # iteration 0 again


def test_a_resume_continues_the_run_that_saved_its_checkpoint(tmp_path):
    """The latest checkpoint (a requeue), or the one before a crash (the iterations since are
    logged again; wandb keeps the first)."""
    save = run_dir(tmp_path, tracker=6, saves={"3": "a", "6": "a"}, last={"a": 6})
    assert wandbrun.choose(run_args(save)) == ("a", "continuing wandb run a (it saved iteration 6)")
    assert wandbrun.choose(run_args(save, "--ckpt-step=6"))[0] == "a"


def test_a_rewind_opens_a_new_run_and_its_branch_is_continued_later(tmp_path):
    """--ckpt-step 3 of a run that saved 6: its steps 4..6 are logged there, and wandb would
    drop the new branch's; the branch's own saves are continued afterwards, and 3 stays a
    rewind."""
    save = run_dir(tmp_path, tracker=6, saves={"3": "a", "6": "a"}, last={"a": 6})
    rid, line = wandbrun.choose(run_args(save, "--ckpt-step", "3"))
    assert rid is None
    assert line == ("a new wandb run: iteration 3 is a rewind of wandb run a, which went on to "
                    "save iteration 6 (its later history stays there)")  # fmt: skip
    (save / wandbrun.FILE).write_text(
        json.dumps({"saves": {"3": "a", "6": "b"}, "last": {"a": 6, "b": 6}})
    )  # the branch b saved 6
    assert wandbrun.choose(run_args(save))[0] == "b"
    assert wandbrun.choose(run_args(save, "--ckpt-step=3"))[0] is None
    (save / wandbrun.FILE).write_text("{not json")
    assert wandbrun.choose(run_args(save)) == (
        None, "a new wandb run (iteration 6 was saved without a wandb run noted)")  # fmt: skip


def test_prepare_sets_wandbs_variables_and_leaves_a_users(tmp_path, monkeypatch):
    save = run_dir(tmp_path, tracker=2, saves={"2": "a"}, last={"a": 2})
    monkeypatch.delenv("WANDB_RUN_ID", raising=False)
    monkeypatch.delenv("WANDB_RESUME", raising=False)
    assert wandbrun.prepare(parse([f"--save={save}", f"--load={save}"])) is None  # no wandb
    assert "WANDB_RUN_ID" not in os.environ
    assert wandbrun.prepare(run_args(save)) == "continuing wandb run a (it saved iteration 2)"
    env = os.environ
    assert (env["WANDB_RUN_ID"], env["WANDB_RESUME"]) == ("a", "allow")
    monkeypatch.setenv("WANDB_RUN_ID", "mine")
    monkeypatch.setenv("WANDB_RESUME", "must")
    assert wandbrun.prepare(run_args(save)) == "wandb run mine (WANDB_RUN_ID, set outside)"
    assert (env["WANDB_RUN_ID"], env["WANDB_RESUME"]) == ("mine", "must")


@pytest.mark.parametrize("tracker", ["release", "garbage"])
def test_a_tracker_that_names_no_iteration_opens_a_new_run(tmp_path, tracker):
    save = run_dir(tmp_path, tracker=tracker, saves={"2": "a"}, last={"a": 2})
    assert wandbrun.choose(run_args(save))[0] is None

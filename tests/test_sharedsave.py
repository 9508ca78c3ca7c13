"""megatron/md/train/sharedsave.py: a ``--save`` (or a directory of the logs the last rank
writes) that some node does not share stops the run before it trains. A second node is rank 1
in its own mount namespace, where an empty tmpfs is mounted over ``--save``: the same path,
another directory, as a node-local ``/tmp`` is."""

import pytest
from _nodes import NODES, ROOT, ranks

from megatron.md import errors

pytestmark = [pytest.mark.distributed, NODES]

#: a rank: gloo set up from the launcher's variables, then the check on argv[1]
CHECK = r"""
import os, sys
import torch.distributed as dist
from megatron.md import errors
from megatron.md.train import sharedsave, shutdown
dist.init_process_group("gloo")
with errors.one_line():
    sharedsave.check(sys.argv[1], [("--tensorboard-dir", d) for d in sys.argv[2:]])
os.write(1, b"shared\n")
shutdown.exit_now()  # as pretrain_gpt.py ends: gloo's teardown in the interpreter's exit, its
# peer gone, aborted now and then (-6, "terminate called without an active exception")
"""


def test_a_save_every_node_shares_passes_and_is_left_as_it_was(tmp_path):
    save = tmp_path / "run"
    outs = ranks(save, ["-c", CHECK, str(save)], node_local=False)
    assert [(o.returncode, o.stdout) for o in outs] == [(0, "shared\n")] * 2, outs
    assert list(save.iterdir()) == []  # the probe removed


def test_a_node_local_save_is_refused_naming_the_node(tmp_path):
    save = tmp_path / "run"
    outs = ranks(save, ["-c", CHECK, str(save)], node_local=True)
    assert [o.returncode for o in outs] == [errors.STATUS] * 2, outs
    assert outs[0].stderr.startswith(
        f"pretrain_gpt.py: error: --save {save} is not one directory for every node: rank 1 on "
    ), outs[0].stderr
    assert "a node-local disk such as /tmp?" in outs[0].stderr
    assert outs[1].stderr == "" and outs[1].stdout == ""  # said once, by rank 0
    assert list(save.iterdir()) == []


def test_pretrain_gpt_with_a_node_local_save_stops_before_training(tmp_path):
    """The real run: the check sits in megatron's ``setup_model_and_optimizer``, before the
    model is built (megatron's line naming its parameter count never printed); rank 0's own
    ``--save`` holds no checkpoint afterwards, and nothing trained."""
    save = tmp_path / "run"
    metrics = tmp_path / "metrics.jsonl"
    argv = [str(ROOT / "pretrain_gpt.py"), "--preset=tiny", "--mock-data",
            "--tokenizer-type=NullTokenizer", "--vocab-size=1024", "--seq-length=64",
            "--max-position-embeddings=64", "--micro-batch-size=2", "--global-batch-size=4",
            "--train-iters=4", "--eval-iters=0", "--lr=1e-3", "--optimizer=adam",
            "--md-decoupling", "--use-distributed-optimizer", f"--save={save}",
            "--save-interval=2", f"--metrics-file={metrics}"]  # fmt: skip
    outs = ranks(save, argv, node_local=True)
    assert [o.returncode for o in outs] == [errors.STATUS] * 2, outs[0].stderr[-3000:]
    assert f"error: --save {save} is not one directory for every node" in outs[0].stderr
    assert "Traceback" not in outs[0].stderr + outs[1].stderr, outs[1].stderr[-3000:]
    # no model built (megatron's line, shown printed by a run that builds one: test_pretrain_e2e)
    assert "number of parameters" not in outs[0].stdout + outs[1].stdout
    assert sorted(p.name for p in save.iterdir()) == [".run.lock"]  # rank 0's lock only
    rows = metrics.read_text().splitlines() if metrics.exists() else []
    assert not [r for r in rows if '"type": "train"' in r], rows


def test_pretrain_gpt_with_node_local_metrics_stops_before_training(tmp_path):
    """The real run, --save shared and --metrics-file on the last rank's node-local disk: the
    metrics file's flag is named before anything trains (the check reads the run's flags)."""
    save, logs = tmp_path / "run", tmp_path / "logs"
    argv = [str(ROOT / "pretrain_gpt.py"), "--preset=tiny", "--mock-data",
            "--tokenizer-type=NullTokenizer", "--vocab-size=1024", "--seq-length=64",
            "--max-position-embeddings=64", "--micro-batch-size=2", "--global-batch-size=4",
            "--train-iters=4", "--eval-iters=0", "--lr=1e-3", "--optimizer=adam",
            "--use-distributed-optimizer", f"--save={save}", "--save-interval=2",
            f"--metrics-file={logs / 'metrics.jsonl'}"]  # fmt: skip
    outs = ranks(logs, argv, node_local=True)
    assert [o.returncode for o in outs] == [errors.STATUS] * 2, outs[0].stderr[-3000:]
    assert f"error: --metrics-file {logs} is not one directory for every node" in outs[0].stderr
    assert sorted(p.name for p in save.iterdir()) == [".run.lock"]
    assert list(logs.iterdir()) == []  # rank 0's view: no probe left, no rows


def test_a_node_local_log_directory_is_refused_naming_its_flag(tmp_path):
    """--save shared, --tensorboard-dir on rank 1's node-local disk: the logs' flag is named,
    with the last rank's host (which alone writes them), and both directories are left empty."""
    save, tb = tmp_path / "run", tmp_path / "tb"
    save.mkdir()
    outs = ranks(tb, ["-c", CHECK, str(save), str(tb)], node_local=True)
    assert [o.returncode for o in outs] == [errors.STATUS] * 2, outs
    err = outs[0].stderr
    assert err.startswith(
        f"pretrain_gpt.py: error: --tensorboard-dir {tb} is not one directory for every node: "
        "rank 1 on "
    ), err
    assert "The run's last rank, on " in err and "writes its logs there" in err
    assert list(save.iterdir()) == [] and list(tb.iterdir()) == []


def test_a_log_directory_rank_0_cannot_write_stops_every_rank_at_once(tmp_path):
    """A --tensorboard-dir under a file: rank 0's probe fails; every rank stops on the one line
    (none waits for another), and the --save probe rank 0 had written is removed."""
    save, tb = tmp_path / "run", tmp_path / "afile" / "tb"
    (tmp_path / "afile").write_text("")
    outs = ranks(save, ["-c", CHECK, str(save), str(tb)], node_local=False)
    assert [o.returncode for o in outs] == [errors.STATUS] * 2, outs
    assert outs[0].stderr.startswith(
        f"pretrain_gpt.py: error: --tensorboard-dir {tb} cannot be written ("
    ), outs[0].stderr
    assert outs[1].stderr == "" and list(save.iterdir()) == []


def test_the_log_directories_are_the_ones_the_last_rank_writes(tmp_path, monkeypatch):
    """metrics.py's file (default beside the checkpoints), megatron's TensorBoard directory, and
    wandb's only when it runs offline (online its runs are on wandb's server)."""
    from types import SimpleNamespace

    from megatron.md.train import sharedsave

    a = SimpleNamespace(metrics_file=None, save=str(tmp_path / "run"), tensorboard_dir="tb",
                        wandb_project="p", wandb_save_dir=str(tmp_path / "wb"))  # fmt: skip
    monkeypatch.setenv("WANDB_MODE", "online")
    assert sharedsave.log_dirs(a) == [("--metrics-file", str(tmp_path / "run")),
                                      ("--tensorboard-dir", "tb")]  # fmt: skip
    monkeypatch.setenv("WANDB_MODE", "offline")
    assert sharedsave.log_dirs(a)[-1] == ("--wandb-save-dir", str(tmp_path / "wb"))
    monkeypatch.chdir(tmp_path)  # a relative file: where the writing rank's cwd puts it
    a.metrics_file, a.save = "m/x.jsonl", None
    assert sharedsave.log_dirs(a)[0] == ("--metrics-file", str(tmp_path / "m"))

"""megatron/md/train/sharedsave.py: a ``--save`` that some node does not share stops the run
before it trains. A second node is rank 1 in its own mount namespace, where an empty tmpfs is
mounted over ``--save``: the same path, another directory, as a node-local ``/tmp`` is."""

import pytest
from _nodes import NODES, ROOT, ranks

from megatron.md import errors

pytestmark = [pytest.mark.distributed, NODES]

#: a rank: gloo set up from the launcher's variables, then the check on argv[1]
CHECK = r"""
import os, sys
import torch.distributed as dist
from megatron.md import errors
from megatron.md.train import sharedsave
dist.init_process_group("gloo")
with errors.one_line():
    sharedsave.check(sys.argv[1])
os.write(1, b"shared\n")
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
    """The real run: the check sits in megatron's ``get_megatron_optimizer`` (after the model is
    built, before a checkpoint is loaded or an iteration trained); rank 0's own ``--save``
    holds no checkpoint afterwards, and nothing trained."""
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
    assert sorted(p.name for p in save.iterdir()) == [".run.lock"]  # rank 0's lock only
    rows = metrics.read_text().splitlines() if metrics.exists() else []
    assert not [r for r in rows if '"type": "train"' in r], rows

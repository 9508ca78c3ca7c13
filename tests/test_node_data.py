"""A second node that reads its own ``--data-path`` copy and dataset cache (a corpus copied to
each node's local disk, the default cache beside it): rank 1 in its own mount namespace, where
the data directory is a tmpfs holding that node's copy (tests/_nodes.py). Real 2-rank
``pretrain_gpt.py`` runs (megatron/md/train/datacache.py, datacheck.check_same_samples)."""

import json
import socket

import pytest
from _nodes import NODES, ROOT, ranks
from test_datacache import corpus, uneven

from megatron.md import errors

pytestmark = [pytest.mark.distributed, NODES]


def run(tmp_path, seed: int | None, build=corpus) -> tuple[list, list]:
    """4 iterations at 2 ranks on ``data/corpus``; rank 1's node holds a copy made by
    ``build(path, seed)`` (seed 0: the same corpus; None: no copy). Returns the ranks' results
    and the metrics file's rows."""
    data, copy = tmp_path / "data", tmp_path / "copy"
    data.mkdir()
    copy.mkdir()
    prefix = corpus(data / "corpus")
    if seed is not None:
        build(copy / "corpus", seed)
    metrics = tmp_path / "metrics.jsonl"
    argv = [str(ROOT / "pretrain_gpt.py"), "--preset=tiny", f"--data-path={prefix}",
            "--split=98,2,0", "--tokenizer-type=NullTokenizer", "--vocab-size=1024",
            "--seq-length=64", "--max-position-embeddings=64", "--micro-batch-size=2",
            "--global-batch-size=4", "--train-iters=4", "--eval-iters=1", "--eval-interval=4",
            "--lr=1e-3", "--optimizer=adam", "--md-decoupling", "--use-distributed-optimizer",
            "--log-interval=1", f"--metrics-file={metrics}"]  # fmt: skip
    fill = f'cp {copy}/* "$0"' if seed is not None else ""
    outs = ranks(data, argv, node_local=True, fill=fill, kill_on_bad_exit=seed is None)
    rows = [json.loads(r) for r in metrics.read_text().splitlines()] if metrics.exists() else []
    return outs, rows


def test_a_second_node_with_its_own_copy_of_the_corpus_builds_its_cache_and_trains(tmp_path):
    """megatron builds a missed cache on rank 0 only and rank 1 loads it; where rank 1's node
    has its own cache directory, that stopped the run with a FileNotFoundError after the model
    was built (checked by hand, 2026-11-28). Now the node builds its own indices, said once per
    split, and the run trains."""
    outs, rows = run(tmp_path, seed=0)
    assert [o.returncode for o in outs] == [0, 0], outs[1].stderr[-3000:]
    said = [x for x in outs[1].stdout.splitlines() if x.startswith("[megatron-md] dataset cache")]
    assert [x.split("GPTDataset-")[1].split("-")[0] for x in said] == ["train", "valid"], said
    assert all(": not there on " in x and "building it on this node" in x for x in said)
    assert "[megatron-md] dataset cache" not in outs[0].stdout  # rank 0 built its own quietly
    assert [r["iteration"] for r in rows if r.get("type") == "train"] == [1, 2, 3, 4]


def test_a_second_node_with_another_corpus_stops_before_training(tmp_path):
    """Rank 1's node holds another corpus under the same name (a stale copy): megatron trained
    that node on other samples, without a word. Now the run stops once the datasets are built,
    before the first iteration, in one line from rank 0 naming the rank, the split and the
    first sample that differs."""
    outs, rows = run(tmp_path, seed=1)
    assert [o.returncode for o in outs] == [errors.STATUS] * 2, outs[0].stderr[-3000:]
    last = outs[0].stderr.strip().splitlines()[-1]
    assert last.startswith("pretrain_gpt.py: error: rank 1 on "), last
    assert "reads other train samples than rank 0 on " in last
    assert "(sample 0 differs)" in last and "--data-cache-path" in last
    assert "Traceback" not in outs[0].stderr + outs[1].stderr, outs[1].stderr[-3000:]
    assert "error:" not in outs[1].stderr  # said once, by rank 0
    assert not [r for r in rows if r.get("type") == "train"]
    assert " > number of parameters on " in outs[0].stdout  # found once the data was built


def test_a_second_node_with_another_version_of_the_corpus_stops_before_the_model(tmp_path):
    """Rank 1's node holds a copy of the same size whose documents have other lengths: found
    before the model is built (datacheck.check_same_files: the .idx's pieces), in one line
    from rank 0 naming the rank, the dataset and how it differs; it was found only after the
    model, the checkpoint load and the datasets' build."""
    outs, rows = run(tmp_path, seed=0, build=uneven)
    assert [o.returncode for o in outs] == [errors.STATUS] * 2, outs[0].stderr[-3000:]
    last = outs[0].stderr.strip().splitlines()[-1]
    assert last == (f"pretrain_gpt.py: error: rank 1 on {socket.gethostname()} reads other "
                    f"data than rank 0 on {socket.gethostname()}: {tmp_path}/data/corpus (the "
                    "same sizes, other document lengths in its .idx): that node's copy of the "
                    "corpus is not rank 0's (another version of it): give every node the same "
                    "data"), last  # fmt: skip
    assert " > number of parameters on " not in outs[0].stdout  # the model was not built
    assert "Traceback" not in outs[0].stderr + outs[1].stderr and "error:" not in outs[1].stderr
    assert [r["type"] for r in rows] == ["run"]  # the run's row at start-up, nothing trained


def test_a_second_node_without_the_corpus_says_so(tmp_path):
    """Rank 1's node has no copy of the corpus (its copy failed): its ranks stopped at
    start-up without a word (a refusal was rank 0's to say, and rank 0's node has the data),
    and the job ended with status 2 and no reason once the launcher ended the other node.
    Now the node's first rank says it, naming itself; and leaves the line for the launcher."""
    outs, rows = run(tmp_path, seed=None)
    assert outs[1].returncode == errors.STATUS, outs[1].stderr[-3000:]
    last = outs[1].stderr.strip().splitlines()[-1]
    assert last == (f"pretrain_gpt.py: error: --data-path: {tmp_path}/data/corpus.bin does not "
                    "exist (build it with tools/preprocess_data.py) (on "
                    f"{socket.gethostname()}, rank 1)"), last  # fmt: skip
    assert "Traceback" not in outs[1].stderr and "error:" not in outs[0].stderr
    assert not rows

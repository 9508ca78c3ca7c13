"""megatron-core's dataset index cache written whole (megatron/md/train/datacache.py): runs
sharing a cache (a sweep on one dataset) must not crash each other while one builds it."""

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch

from megatron.md import compat
from megatron.md.launch import free_port
from megatron.md.train import datacache

ROOT = Path(__file__).resolve().parents[1]

ROWS = [s for s in compat.SEAMS if s.replace == "megatron.md.train.datacache:atomic_build"]


def build(prefixes, cache, samples, weights=None, seed=1):
    """The train split of a GPTDataset blend of ``prefixes``, cached in ``cache``, as megatron's
    builder makes it (5M samples of 8 tokens: a 40 MB sample index, written in ~0.1 s, long
    enough for a reader to meet a cut file)."""
    from megatron.core.datasets.blended_megatron_dataset_builder import (
        BlendedMegatronDatasetBuilder,
    )
    from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig
    from megatron.core.tokenizers.text.libraries.null_tokenizer import NullTokenizer

    cfg = GPTDatasetConfig(
        random_seed=seed, sequence_length=8, blend=(prefixes, weights), split="100,0,0",
        path_to_cache=cache, tokenizer=NullTokenizer(1000), reset_position_ids=False,
        reset_attention_mask=False, eod_mask_loss=False, create_attention_mask=False,
    )  # fmt: skip
    return BlendedMegatronDatasetBuilder(GPTDataset, [samples, 0, 0], lambda: True, cfg).build()[0]


#: a run's data loader: the cached sample index mapped and read, over and over, until told to
#: stop (numpy only: starts in a fraction of a second)
READ = textwrap.dedent(r"""
    import os, sys
    import numpy as np
    index = np.load(sys.argv[1], mmap_mode="r")
    print("mapped", flush=True)
    sweeps = 0
    while not os.path.exists(sys.argv[2]) or sweeps < 3:
        sweeps += int(np.asarray(index[::512]).sum() > 0)
    print("read", sweeps, flush=True)
""")


def corpus(path: Path, seed: int = 0, length: int | tuple[int, int] = 500, docs: int = 400) -> str:
    """``docs`` documents of ``length`` random tokens (a pair: its lengths in turn)."""
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    lengths = length if isinstance(length, tuple) else (length, length)
    b = IndexedDatasetBuilder(f"{path}.bin", dtype=np.uint16)
    rng = np.random.default_rng(seed)
    for d in range(docs):
        b.add_item(torch.from_numpy(rng.integers(0, 1000, lengths[d % 2]).astype(np.int64)))
        b.end_document()
    b.finalize(f"{path}.idx")
    return str(path)


def uneven(path, seed: int) -> str:
    """The corpus's sizes (400 documents, 200,000 tokens) with other document lengths: 499
    and 501 tokens in turn (another tokenization of the same text, say)."""
    return corpus(path, seed, (499, 501))


def apply_seams() -> list:
    """The cache seams applied in this process (as ``pretrain_gpt.py`` applies them); returns
    megatron's own builders to put back."""
    assert len(ROWS) == 2  # GPTDataset's and BlendedDataset's
    saved = [(compat.owner(s), getattr(*compat.owner(s))) for s in ROWS]
    for (holder, name), orig in saved:
        setattr(holder, name, datacache.atomic_build(getattr(orig, "__md_seam__", orig)))
    return saved


@pytest.fixture
def seam():
    """The cache seams applied, megatron's own builders back afterwards."""
    saved = apply_seams()
    yield
    for (holder, name), orig in saved:
        setattr(holder, name, orig)


#: a run's rank 0 building the cache, held inside megatron's first ``numpy.save`` of an index
#: (argv: this folder, the data prefix, the cache)
HELD = textwrap.dedent(r"""
    import os, sys, time
    sys.path.insert(0, sys.argv[1])
    import numpy as np
    import test_datacache as t
    t.apply_seams()
    def held(*args, **kwargs):
        os.write(1, b"building\n")
        time.sleep(600)
    np.save = held
    t.build([sys.argv[2]], sys.argv[3], 1000)
""")


def test_a_second_build_does_not_kill_a_run_reading_the_cache(tmp_path, seam):
    """A run maps the cached sample index and reads it (its data loader); another run that
    missed the cache when it started builds it again meanwhile. megatron's own in-place
    ``numpy.save`` truncates the mapped file and kills the reader with SIGBUS (checked by hand:
    this test without the seam, 2026-11-27); written whole, the new files replace the names
    and the reader reads on."""
    prefix = corpus(tmp_path / "corpus")
    cache = tmp_path / "cache"
    build([prefix], str(cache), 5_000_000)  # the first run
    (desc,) = cache.glob("*-description.txt")
    index = next(cache.glob("*-sample_index.npy"))
    inode, size = index.stat().st_ino, index.stat().st_size
    assert size > 30e6
    stop = tmp_path / "stop"
    reader = subprocess.Popen([sys.executable, "-c", READ, str(index), str(stop)],
                              stdout=subprocess.PIPE, text=True)  # fmt: skip
    try:
        assert reader.stdout.readline().strip() == "mapped"
        desc.unlink()  # the second run checked the cache before the first had written it
        build([prefix], str(cache), 5_000_000)  # the second run
    finally:
        stop.touch()
    out = reader.communicate(timeout=60)[0]
    assert reader.returncode == 0, f"the reader died: {signal.Signals(-reader.returncode).name}"
    assert out.startswith("read ") and int(out.split()[1]) >= 3
    assert index.stat().st_ino != inode and index.stat().st_size == size  # replaced, not cut
    assert sorted(p.name for p in cache.iterdir() if p.name.startswith(".")) == []


def test_a_missed_cache_is_built_whole_and_loads_as_megatron_builds_it(tmp_path, seam):
    """With the seam, a miss builds the same indices megatron builds (train split of a
    two-dataset blend: GPTDataset's and BlendedDataset's caches), every file lands in the cache
    and no private directory is left; the next build loads them (a hit: the files untouched)."""
    a, b = corpus(tmp_path / "a", 0), corpus(tmp_path / "b", 1)
    ours = tmp_path / "ours"
    built = build([a, b], str(ours), 4000, [0.3, 0.7])
    names = sorted(p.name.split("-", 1)[1] for p in ours.iterdir())
    # megatron's files, and what each was built from (the seam's note)
    assert names == sorted(
        [f"BlendedDataset-train-{f}" for f in
         ("description.txt", "dataset_index.npy", "dataset_sample_index.npy", "md_source.json")]
        + [f"GPTDataset-train-{f}" for f in
           ("description.txt", "document_index.npy", "sample_index.npy", "shuffle_index.npy",
            "md_source.json")] * 2
    )  # fmt: skip
    stamps = {p.name: p.stat().st_mtime_ns for p in ours.iterdir()}
    again = build([a, b], str(ours), 4000, [0.3, 0.7])
    assert {p.name: p.stat().st_mtime_ns for p in ours.iterdir()} == stamps  # loaded
    theirs = tmp_path / "theirs"
    for s in ROWS:  # megatron's own builders (the fixture puts them back)
        holder, name = compat.owner(s)
        setattr(holder, name, getattr(holder, name).__wrapped__)
    plain = build([a, b], str(theirs), 4000, [0.3, 0.7])
    for p in theirs.iterdir():
        q = ours / p.name
        if p.suffix == ".npy":
            assert np.array_equal(np.load(p), np.load(q)), p.name
        else:
            assert p.read_text() == q.read_text()
    for i in (0, 1, 1234, 3999):
        assert torch.equal(torch.as_tensor(built[i]["tokens"]), torch.as_tensor(plain[i]["tokens"]))
        assert torch.equal(torch.as_tensor(again[i]["tokens"]), torch.as_tensor(plain[i]["tokens"]))


def test_a_builder_that_names_its_files_otherwise_stops_the_run(tmp_path):
    """If megatron-core names its cache files differently, the seam cannot know a hit from a
    miss: the first build says so, naming the file it expected, and leaves nothing behind."""
    prefix = corpus(tmp_path / "corpus")
    from megatron.core.datasets.gpt_dataset import GPTDataset

    orig = GPTDataset._build_document_sample_shuffle_indices
    plain = getattr(orig, "__md_seam__", orig)

    def renamed(self):
        out = plain(self)
        for p in Path(self.config.path_to_cache).iterdir():
            p.rename(p.with_name("v2-" + p.name))
        return out

    GPTDataset._build_document_sample_shuffle_indices = datacache.atomic_build(renamed)
    try:
        with pytest.raises(Exception) as e:
            build([prefix], str(tmp_path / "cache"), 1000)
    finally:
        GPTDataset._build_document_sample_shuffle_indices = orig
    assert "seam into megatron-core's dataset cache no longer fits" in str(e.value)
    assert "-GPTDataset-train-description.txt" in str(e.value)
    assert list((tmp_path / "cache").iterdir()) == []


def test_a_killed_build_s_leftovers_are_removed_by_the_next_build(tmp_path, seam):
    """A build killed outright (kill -9 of rank 0 while megatron writes the indices) leaves its
    private directory behind; the next build in that cache removes it, and leaves alone a build
    still running in another process and one of another host."""
    prefix = corpus(tmp_path / "corpus")
    cache = tmp_path / "cache"
    argv = [sys.executable, "-c", HELD, str(Path(__file__).parent), prefix, str(cache)]
    runs = [subprocess.Popen(argv, stdout=subprocess.PIPE, text=True) for _ in range(2)]
    try:
        for r in runs:
            assert r.stdout.readline().strip() == "building"
        killed, live = runs
        killed.kill()
        killed.wait()
        left = sorted(p.name for p in cache.iterdir())
        assert [n.rsplit("-", 1)[1] for n in left] == sorted([str(killed.pid), str(live.pid)])
        assert all(n.startswith(".") and "-GPTDataset-train-building-" in n for n in left)
        here = datacache.builder().rsplit("-", 1)[0]
        elsewhere = f".x-{here.replace(socket.gethostname(), 'another-host')}-{killed.pid}"
        (cache / elsewhere).mkdir()
        build([prefix], str(cache), 1000)
        assert sorted(p.name for p in cache.iterdir() if p.name.startswith(".")) == sorted(
            [elsewhere, *(n for n in left if n.endswith(f"-{live.pid}"))]
        )
        assert len(list(cache.glob("*-description.txt"))) == 1  # built
    finally:
        for r in runs:
            r.kill()
            r.wait()


#: a run's rank 0 whose cache misses, in a mount namespace where the cache is read-only
#: (argv: this folder, the data prefix, the cache)
READ_ONLY = textwrap.dedent(r"""
    import sys
    sys.path.insert(0, sys.argv[1])
    import test_datacache as t
    from megatron.md import errors
    t.apply_seams()
    with errors.one_line():
        t.build([sys.argv[2]], sys.argv[3], 1000)
""")


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("unshare") is None,
                    reason="a read-only mount needs root and util-linux's unshare")  # fmt: skip
def test_a_miss_in_a_cache_that_cannot_be_written_is_named(tmp_path):
    """A cache directory that exists (it holds other runs' indices) but is read-only: a run whose
    indices are not there stops in one line naming the directory and --data-cache-path, not with
    megatron's traceback from inside its dataset build."""
    prefix = corpus(tmp_path / "corpus")
    cache = tmp_path / "cache"
    cache.mkdir()
    ro = 'mount --bind "$0" "$0" && mount -o remount,bind,ro "$0" && exec "$@"'
    here = str(Path(__file__).parent)
    argv = ["unshare", "-m", "sh", "-c", ro, str(cache),
            sys.executable, "-c", READ_ONLY, here, prefix, str(cache)]  # fmt: skip
    out = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    last = out.stderr.strip().splitlines()[-1]
    assert out.returncode == 2, out.stderr[-3000:]
    assert last.startswith(
        f"pretrain_gpt.py: error: dataset cache {cache}: GPTDataset's indices for this run ("
    ), out.stderr[-3000:]
    assert "Read-only file system" in last and "--data-cache-path" in last
    assert "Traceback" not in out.stderr
    assert list(cache.iterdir()) == []


def tokens(ds, picks=(0, 1, 17, 500, 999)) -> list:
    return [np.asarray(ds[i]["tokens"]).tolist() for i in picks]


def test_a_cache_of_a_corpus_preprocessed_again_is_built_again(tmp_path, seam, capsys):
    """The corpus preprocessed again under the same prefix (here 300-token documents where there
    were 500): megatron's own builder takes the old cache (its name holds the settings, not the
    data) and reads the new files through the old indices; with the seam the cache is built
    again, said once, samples as a fresh cache gives them, and the next build loads it."""
    prefix = corpus(tmp_path / "corpus")
    cache = tmp_path / "cache"
    build([prefix], str(cache), 1000)
    corpus(tmp_path / "corpus", seed=1, length=300)  # the same prefix, preprocessed again
    fresh = tokens(build([prefix], str(tmp_path / "fresh"), 1000))
    for s in ROWS:  # megatron's own builders on the old cache: no rebuild
        holder, name = compat.owner(s)
        setattr(holder, name, getattr(holder, name).__wrapped__)
    stamps = {p.name: p.stat().st_mtime_ns for p in cache.iterdir()}
    assert tokens(build([prefix], str(cache), 1000)) != fresh
    assert {p.name: p.stat().st_mtime_ns for p in cache.iterdir()} == stamps
    apply_seams()
    capsys.readouterr()
    assert tokens(build([prefix], str(cache), 1000)) == fresh
    said = capsys.readouterr().out
    assert said.count("[megatron-md] dataset cache ") == 1 and "building it again" in said, said
    (note,) = cache.glob("*md_source.json")
    assert json.loads(note.read_text()) == {
        "bin": Path(prefix + ".bin").stat().st_size, "idx": Path(prefix + ".idx").stat().st_size
    }  # fmt: skip
    stamps = {p.name: p.stat().st_mtime_ns for p in cache.iterdir()}
    assert tokens(build([prefix], str(cache), 1000)) == fresh  # a hit now
    assert {p.name: p.stat().st_mtime_ns for p in cache.iterdir()} == stamps
    assert "dataset cache" not in capsys.readouterr().out


#: a rank of a gloo job building a blend (argv: this folder, the cache, the data prefixes):
#: megatron's builder builds on rank 0, then, after a barrier, on the others
RANK = textwrap.dedent(r"""
    import json, os, sys
    sys.path.insert(0, sys.argv[1])
    import torch.distributed as dist
    import test_datacache as t
    t.apply_seams()
    dist.init_process_group("gloo")
    ds = t.build(sys.argv[3:], sys.argv[2], 1000, [0.5, 0.5])
    os.write(1, ("tokens " + json.dumps(t.tokens(ds)) + "\n").encode())
""")


@pytest.mark.distributed
def test_a_node_that_does_not_see_rank_0_s_cache_builds_its_own_once(tmp_path, seam):
    """Three gloo ranks: rank 0 with its cache, ranks 1 and 2 (a second node) with another, as
    a cache beside a corpus copied to each node's disk is. megatron's ranks 1 and 2 loaded
    rank 0's files where their node has none: FileNotFoundError after the model was built
    (checked by hand with a real 2-rank ``pretrain_gpt.py``, 2026-11-28). Here the second
    node's cache holds a GPTDataset built from the corpus before it was preprocessed again and
    no blend: one of its ranks builds both (one line each), the other then loads them; the
    second node's files are rank 0's, and every rank reads the same samples."""
    a, b = corpus(tmp_path / "a", 0), corpus(tmp_path / "b", 1)
    caches = [tmp_path / "node0", tmp_path / "node1"]
    build([a, b], str(caches[1]), 1000, [0.5, 0.5])  # the second node's old cache
    for p in caches[1].glob("*BlendedDataset*"):
        p.unlink()
    corpus(tmp_path / "a", 2, 300)  # preprocessed again (copied to both nodes)
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()),
           "WORLD_SIZE": "3", "OMP_NUM_THREADS": "1"}  # fmt: skip
    here = str(Path(__file__).parent)
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", RANK, here, str(caches[min(r, 1)]), a, b],
            env={**env, "RANK": str(r)},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )  # fmt: skip
        for r in range(3)
    ]
    outs = [(p.communicate(timeout=300), p.returncode) for p in procs]
    assert [rc for _, rc in outs] == [0] * 3, [err[-3000:] for (_, err), _ in outs]
    said = [line for (out, _), _ in outs for line in out.splitlines()]
    toks = {line for line in said if line.startswith("tokens ")}
    assert len(toks) == 1, said  # every rank reads the same samples
    built = [line for line in said if line.startswith("[megatron-md] dataset cache")]
    assert len(built) == 2, said  # the second node: its stale GPTDataset, its missing blend
    assert any(f"{caches[1]}/" in b and "GPTDataset-train-*: built from" in b for b in built)
    assert any("BlendedDataset-train-*: not there on " in b for b in built)
    assert all("building it on this node" in b for b in built)
    names = sorted(p.name for p in caches[0].iterdir())
    assert sorted(p.name for p in caches[1].iterdir() if not p.name.startswith(".")) == names
    for name in names:
        mine, theirs = caches[0] / name, caches[1] / name
        if name.endswith(".npy"):
            assert np.array_equal(np.load(mine), np.load(theirs)), name
        else:
            assert mine.read_text() == theirs.read_text(), name
    hidden = sorted(p.name for p in caches[1].iterdir() if p.name.startswith("."))
    assert len(hidden) == 2 and all(h.endswith("-train-lock") for h in hidden), hidden  # built


def test_the_sample_order_is_compared_besides_the_samples(tmp_path, seam):
    """datacheck.fingerprint: the same blend from two caches (two nodes') fingerprints alike;
    another shuffle (here another seed: as a cache megatron built from another version of the
    corpus orders it) changes the order's CRC, and where the samples compared happen to agree
    the refusal names the order."""
    from megatron.md.train.datacheck import differ, fingerprint, order_crc

    a, b = corpus(tmp_path / "a", 0), corpus(tmp_path / "b", 1)
    one = build([a, b], str(tmp_path / "n0"), 1000, [0.5, 0.5])
    two = build([a, b], str(tmp_path / "n1"), 1000, [0.5, 0.5])
    other = build([a, b], str(tmp_path / "n2"), 1000, [0.5, 0.5], seed=2)
    assert fingerprint(one) == fingerprint(two)
    assert order_crc(one) != order_crc(other)
    assert order_crc(one.datasets[0]) != order_crc(other.datasets[0])  # a GPTDataset's own
    n, samples, crc = fingerprint(one)
    assert differ((n, samples, crc), (n, samples, crc + 1)).startswith(
        "the samples compared agree, their order differs"
    )


def test_the_files_fingerprint_sees_other_document_lengths_at_the_same_sizes(tmp_path):
    """datacheck.file_fingerprint, what nodes compare before the model is built: a copy of the
    corpus fingerprints alike; one with the same sizes and other document lengths (499 and
    501 tokens in turn), or one token shorter per document, does not."""
    from megatron.md.train.datacheck import file_fingerprint

    a, copy = corpus(tmp_path / "a"), tmp_path / "copy"
    for ext in (".bin", ".idx"):
        shutil.copy(a + ext, str(copy) + ext)
    same_sizes, shorter = uneven(tmp_path / "u", 0), corpus(tmp_path / "s", 0, length=499)
    fa = file_fingerprint(a)
    assert fa == file_fingerprint(str(copy)) and fa[0] == 400 * 500 * 2
    fu = file_fingerprint(same_sizes)
    assert fu[:2] == fa[:2] and fu[2] != fa[2]
    assert file_fingerprint(shorter)[0] == 400 * 499 * 2


def tiny_run(tmp_path, nproc: int, *extra: str) -> tuple[subprocess.CompletedProcess, list]:
    """pretrain_gpt.py, tiny AdamMD, 4 iterations evaluated whole (--full-validation) at 2 and
    4 on ``nproc`` ranks: its output and metrics rows (the 4 training rows asserted)."""
    from megatron.md.launch import local_ranks

    metrics = tmp_path / "m.jsonl"
    argv = ["--preset=tiny", "--tokenizer-type=NullTokenizer", "--vocab-size=1024",
            "--seq-length=64", "--max-position-embeddings=64", "--micro-batch-size=2",
            "--train-iters=4", "--eval-iters=1", "--eval-interval=2", "--lr=1e-3",
            "--optimizer=adam", "--md-decoupling", "--full-validation", "--log-interval=1",
            f"--metrics-file={metrics}", *extra]  # fmt: skip
    out = subprocess.run(local_ranks(ROOT / "pretrain_gpt.py", nproc, argv),
                         capture_output=True, text=True, timeout=600, cwd=tmp_path,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})  # fmt: skip
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    rows = [json.loads(r) for r in metrics.read_text().splitlines()]
    assert [r["iteration"] for r in rows if r["type"] == "train"] == [1, 2, 3, 4]
    return out, rows


@pytest.mark.distributed
def test_one_validation_set_per_dataset_trains_and_is_compared_across_ranks(tmp_path):
    """megatron's ``--multiple-validation-sets --full-validation`` with two validation
    datasets (``--valid-data-path``) reaches the dataset config (data.DATASET_FLAGS; it was
    ignored: megatron then took its one blended validation set for a list and stopped) and
    trains at 2 ranks: the ranks' samples compared per validation set
    (datacheck.check_same_samples), each set's evaluation logged with its
    ``--validation-set-names`` name (without names: its index, metrics.wrap_evaluate)."""

    # --full-validation reads each validation set whole: 4 samples of 64 tokens each
    train = corpus(tmp_path / "train", 0)
    a, b = (corpus(tmp_path / n, s, length=65, docs=4) for n, s in (("a", 1), ("b", 2)))
    out, rows = tiny_run(tmp_path, 2, "--train-data-path", train, "--valid-data-path", a, b,
                         "--global-batch-size=4", "--use-distributed-optimizer",
                         "--multiple-validation-sets", "--validation-set-names", "wiki",
                         "code")  # fmt: skip
    valid = [(r["iteration"], r["set"]) for r in rows if r["type"] == "valid"]
    assert valid[:4] == [(2, "wiki"), (2, "code"), (4, "wiki"), (4, "code")], valid
    assert "validation-code loss at iteration 4" in out.stdout


@pytest.mark.distributed
def test_full_validation_of_one_set_evaluates_and_trains_on(tmp_path):
    """``--full-validation`` with one validation set: megatron-core 0.19.2 stopped at its first
    evaluation (``TypeError: 'int' object is not subscriptable``, training/training.py:4382,
    seen 2026-11-29) after training to it; metrics.wrap_evaluate_and_print gives it the list it
    indexes. Each evaluation reads the whole set: 4 samples, 2 micro-batches of 2."""

    train = corpus(tmp_path / "train", 0)
    a = corpus(tmp_path / "a", 1, length=65, docs=4)
    out, rows = tiny_run(tmp_path, 1, "--train-data-path", train, "--valid-data-path", a,
                         "--global-batch-size=2")  # fmt: skip
    assert [r["iteration"] for r in rows if r["type"] == "valid"][:2] == [2, 4]
    assert "validation loss at iteration 4" in out.stdout

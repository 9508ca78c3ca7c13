"""tools/train_tokenizer.py and tools/preprocess_data.py: text → BPE → .bin/.idx → GPTDataset."""

import json
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))
sys.path.insert(0, str(ROOT / "examples" / "md_decoupling"))
import cpu_demo  # noqa: E402
import preprocess_data  # noqa: E402
import train_tokenizer  # noqa: E402

DOCS = [cpu_demo.TEXT[i : i + 600] for i in range(0, 1800, 600)]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    d = tmp_path_factory.mktemp("data")
    (d / "docs.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in DOCS))
    train_tokenizer.main(
        ["--input", str(d / "docs.jsonl"), "--vocab-size", "300", "--out", str(d / "tok")]
    )
    preprocess_data.main(
        [
            "--input",
            str(d / "docs.jsonl"),
            "--tokenizer-model",
            str(d / "tok"),
            "--output-prefix",
            str(d / "c"),
            "--workers",
            "2",
        ]
    )
    return d


def test_round_trip_reproduces_token_ids(corpus):
    from megatron.core.datasets.indexed_dataset import IndexedDataset
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(corpus / "tok" / "tokenizer.json"))
    eod = tok.token_to_id("<|endoftext|>")
    ds = IndexedDataset(str(corpus / "c_text_document"))
    assert len(ds) == len(DOCS)
    for i, text in enumerate(DOCS):
        ids = list(ds[i])
        assert ids[-1] == eod
        assert ids[:-1] == tok.encode(text).ids
        assert tok.decode(ids[:-1]) == text  # byte-level BPE is lossless


def test_gpt_dataset_windows_come_from_the_documents(corpus):
    from megatron.core.datasets.blended_megatron_dataset_builder import (
        BlendedMegatronDatasetBuilder,
    )
    from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig
    from megatron.core.datasets.indexed_dataset import IndexedDataset
    from megatron.core.tokenizers import MegatronTokenizer

    tok = MegatronTokenizer.from_pretrained(str(corpus / "tok"))
    cfg = GPTDatasetConfig(
        random_seed=1,
        sequence_length=32,
        blend=([str(corpus / "c_text_document")], None),
        split="100,0,0",
        tokenizer=tok,
        reset_position_ids=False,
        reset_attention_mask=False,
        eod_mask_loss=False,
        path_to_cache=str(corpus / "cache"),
    )
    train, _, _ = BlendedMegatronDatasetBuilder(
        GPTDataset, [20, None, None], lambda: True, cfg
    ).build()
    ds = IndexedDataset(str(corpus / "c_text_document"))  # keep it: items are views of its mmap
    stream = np.concatenate([np.array(ds[i]) for i in range(3)])
    text = " ".join(map(str, stream.tolist() * 2)) + " "
    for i in range(20):  # the samples asked for (len(train) may be larger)
        sample = train[i]["tokens"].tolist()
        # the documents are shuffled between epochs, so check each in-document run
        runs = " ".join(map(str, sample[:8])) + " "
        assert runs in text or tok.eod in sample[:8]


def test_progress_lines_have_total_elapsed_and_eta():
    """Whole lines (a SLURM log stays readable), at most one per ``every`` seconds, and the
    last one at the end; the ETA extrapolates the elapsed time."""
    import io

    from megatron.md.progress import Progress

    now, out = [0.0], io.StringIO()
    bar = Progress("job", 4, every=30, out=out, clock=lambda: now[0])
    for t in (10, 20, 40, 90):  # the first prints; the second is inside the 30 s window
        now[0] = t
        bar.update(note=f"at {t}")
    lines = out.getvalue().splitlines()
    assert "\r" not in out.getvalue() and len(lines) == 3
    assert lines[0] == "[job] 1/4 (25 %) · 0m10s · ETA 0m30s · at 10"
    assert lines[1].startswith("[job] 3/4 (75 %) · 0m40s · ETA 0m13s")
    assert lines[2].startswith("[job] 4/4 (100 %) · 1m30s · ETA 0m00s")


def test_preprocess_progress_counts_input_bytes(tmp_path, capsys):
    """The progress line counts the input's bytes (blank JSONL lines are not documents; the
    trailing one is counted at the end): its last line reads the whole file, 100 %."""
    src = tmp_path / "docs.jsonl"
    src.write_text("\n".join(json.dumps({"text": t}) for t in DOCS) + "\n\n")
    train_tokenizer.main(["--input", str(src), "--vocab-size", "300", "--out", str(tmp_path)])
    capsys.readouterr()
    _, n_docs, _ = preprocess_data.preprocess([src], tmp_path, str(tmp_path / "c"))
    err = capsys.readouterr().err
    assert n_docs == len(DOCS) and "\r" not in err
    last = [ln for ln in err.splitlines() if ln.startswith("[preprocess]")][-1]
    mib = f"{src.stat().st_size / 2**20:,.1f} MiB"
    assert last.startswith(f"[preprocess] {mib}/{mib} (100 %)")


def test_existing_outputs_are_refused_and_an_interrupted_run_leaves_them_whole(corpus, monkeypatch):
    """A second preprocess (or tokenizer) into an existing output is refused and leaves it as it
    was; --overwrite replaces it; a run interrupted midway leaves the earlier pair whole and no
    partial file."""
    import preprocess_data as pp

    before = {ext: (corpus / f"c_text_document{ext}").read_bytes() for ext in (".bin", ".idx")}
    args = ["--input", str(corpus / "docs.jsonl"), "--tokenizer-model", str(corpus / "tok"),
            "--output-prefix", str(corpus / "c")]  # fmt: skip
    with pytest.raises(SystemExit, match="c_text_document.bin and .*c_text_document.idx exist"):
        pp.main(args)
    with pytest.raises(SystemExit, match="holds a tokenizer"):
        train_tokenizer.main(["--input", str(corpus / "docs.jsonl"), "--out", str(corpus / "tok")])

    def interrupted(*a, **k):
        raise KeyboardInterrupt

    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    monkeypatch.setattr(IndexedDatasetBuilder, "finalize", interrupted)  # Ctrl-C near the end
    with pytest.raises(KeyboardInterrupt):
        pp.main([*args, "--overwrite"])
    monkeypatch.undo()
    after = {ext: (corpus / f"c_text_document{ext}").read_bytes() for ext in (".bin", ".idx")}
    assert after == before
    assert not list(corpus.glob("*.partial"))
    pp.main([*args, "--overwrite", "--no-append-eod"])  # replaced: no end-of-document tokens
    assert (corpus / "c_text_document.bin").stat().st_size < len(before[".bin"])
    pp.main([*args, "--overwrite"])  # as the module's other tests expect it
    assert (corpus / "c_text_document.bin").read_bytes() == before[".bin"]

"""End to end: pretrain_gpt.py (megatron.training's loop) on 2 gloo processes, tiny presets on
megatron's mock data, for AdamW, Muon, AdamMD, MuonMD (dense) and MuonMD (MoE). Each run must
lower the loss, write the MD diagnostics, save a torch_dist checkpoint whose weights hold the
sphere invariant (MD runs) and whose parameter count is the preset's; AdamMD also resumes
exactly."""

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from megatron.md.train import presets

pytestmark = pytest.mark.distributed
ROOT = Path(__file__).resolve().parents[1]
VOCAB = 1024
COMMON = [
    "--mock-data", "--tokenizer-type=NullTokenizer", f"--vocab-size={VOCAB}",
    "--seq-length=64", "--max-position-embeddings=64", "--micro-batch-size=4",
    "--global-batch-size=8", "--log-interval=1", "--eval-interval=8", "--eval-iters=1",
    "--use-distributed-optimizer", "--seed=7",
]  # fmt: skip
RUNS = {
    "adamw": ["--preset=tiny", "--optimizer=adam", "--lr=3e-3", "--weight-decay=0.1"],
    "muon": [
        "--preset=tiny", "--optimizer=muon", "--lr=1e-2", "--bf16", "--muon-momentum=0.95",
        "--muon-nesterov", "--muon-scale-mode=unit_rms_norm",
    ],
    "adam_md": ["--preset=tiny", "--optimizer=adam", "--md-decoupling", "--lr=1e-2",
                "--md-gain-map=exp"],
    "muon_md": ["--preset=tiny", "--optimizer=muon", "--md-decoupling", "--lr=1e-3",
                "--matrix-lr=2e-2", "--embedding-lr=3e-3", "--output-lr=5e-4", "--bf16"],
    "muon_md_moe": ["--preset=tiny-moe", "--optimizer=muon", "--md-decoupling", "--lr=3e-3",
                    "--matrix-lr=2e-2", "--bf16"],
}  # fmt: skip
DENSE = {"qkv", "proj", "fc1", "fc2", "embeddings", "output"}


def is_md(name: str) -> bool:
    return "md" in name.split("_")


def pretrain(tmp: Path, name: str, *extra: str) -> tuple[list[dict], Path]:
    save = tmp / name
    metrics = tmp / f"{name}.jsonl"
    if is_md(name):  # baselines need no checkpoint here (megatron's own code)
        extra = (*extra, f"--save={save}", "--save-interval=4")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2",
        f"--master-port={port}", str(ROOT / "pretrain_gpt.py"), *COMMON, *extra,
        f"--metrics-file={metrics}",
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env, cwd=tmp)
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-4000:]
    return [json.loads(line) for line in metrics.open()], save


def read_checkpoint(ckpt: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a torch_dist checkpoint, read in one process."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    meta = dcp.FileSystemReader(str(ckpt)).read_metadata().state_dict_metadata
    sd = {
        k: torch.empty(tuple(m.size), dtype=m.properties.dtype)
        for k, m in meta.items()
        if isinstance(m, TensorStorageMetadata)
    }
    dcp.load(sd, storage_reader=dcp.FileSystemReader(str(ckpt)), no_dist=True)
    return sd


def phi(raw: torch.Tensor, gain_map: str) -> torch.Tensor:
    return {"softplus": F.softplus, "exp": torch.exp}.get(gain_map, lambda x: x)(raw)


def sphere_errors(sd: dict, gain_map: str) -> dict[str, float]:
    """|‖Ŵ‖ − c| / c per MD matrix, with Ŵ = W / (g_row g_colᵀ) rebuilt from the saved model
    weight and the saved raw gains (row spheres of embeddings / LM head: per row, no gains).
    MD keys: ``[chained_i.]optimizer.md.<param key>[@layer].<field>``."""
    errs = {}
    for k, radius in sd.items():
        if "optimizer.md." not in k or not k.endswith(".radius"):
            continue
        head, key = k[: -len(".radius")].split("optimizer.md.")
        base, _, idx = key.partition("@")
        w = sd[base]
        for i in map(int, idx.split(",")) if idx else []:
            w = w[i]
        w = w.double()
        g_row = sd.get(f"{head}optimizer.md.{key}.gain_row")
        g_col = sd.get(f"{head}optimizer.md.{key}.gain_col")
        if g_row is not None:
            w = w / phi(g_row.double(), gain_map)[:, None]
        if g_col is not None:
            w = w / phi(g_col.double(), gain_map)[None, :]
        norm = w.norm() if radius.numel() == 1 else w.norm(dim=1)
        errs[key] = float(((norm - radius.double().view(norm.shape)).abs() / radius.double()).max())
    return errs


def model_param_count(sd: dict) -> int:
    skip = ("optimizer.", "_extra_state", "expert_bias", "tokens_per_expert")
    return sum(
        t.numel() for k, t in sd.items() if not k.startswith(("rng", "rerun"))
        and not any(x in k for x in skip)
    )  # fmt: skip


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("pretrain")
    return {name: pretrain(tmp, name, "--train-iters=8", *flags) for name, flags in RUNS.items()}


@pytest.mark.parametrize("name", list(RUNS))
def test_loss_decreases_and_diagnostics_are_logged(runs, name):
    rows, _ = runs[name]
    run = rows[0]
    train = [r for r in rows if r["type"] == "train"]
    assert (
        run["type"] == "run" and run["git"] and [r["iteration"] for r in train] == list(range(1, 9))
    )
    first, last = train[0]["lm loss"], sum(r["lm loss"] for r in train[-2:]) / 2
    assert last < 0.9 * first, (first, last)
    assert any(r["type"] == "valid" for r in rows)
    diag = [r["md"] for r in train if "md" in r]
    assert diag, "no diagnostics"
    classes = DENSE | ({"router", "experts", "shared"} if "moe" in name else set())
    assert set(diag[-1]["rel_update"]) == classes
    assert all(v > 0 for v in diag[-1]["rel_update"].values())
    assert len(diag[-1]["act_rms"]) == 4
    if is_md(name):
        assert run["md_config"] is not None
        drift = diag[-1]["sphere_drift"]
        assert {"embeddings", "output", "qkv", "fc2"} <= set(drift)
        assert max(drift.values()) < 1e-5, drift
        assert 0 < diag[-1]["gain_min"]["fc1"] <= 1 <= diag[-1]["gain_max"]["fc1"]
    else:
        assert run["md_config"] is None and "sphere_drift" not in diag[-1]


@pytest.mark.parametrize("name", [n for n in RUNS if is_md(n)])
def test_checkpoint_counts_and_sphere(runs, name):
    rows, save = runs[name]
    sd = read_checkpoint(save / "iter_0000008")
    preset = presets.PRESETS["tiny-moe" if "moe" in name else "tiny"]
    assert model_param_count(sd) == presets.count_params(preset, vocab=VOCAB)[0]
    errs = sphere_errors(sd, rows[0]["md_config"]["gain_map"])
    assert any("word_embeddings" in k for k in errs) and any("linear_fc1" in k for k in errs)
    tol = 5e-3 if "--bf16" in RUNS[name] else 1e-5  # bf16 model weights vs fp32 directions
    assert max(errs.values()) < tol, sorted(errs.items(), key=lambda kv: -kv[1])[:3]


def test_md_flags_reach_the_optimizer(runs):
    """--md-gain-map reaches the MD config the optimizer saved; per-group LRs reach its groups."""
    from megatron.core import dist_checkpointing

    from megatron.md.checkpoint import _find_md_configs

    common = dist_checkpointing.load_common_state_dict(str(runs["adam_md"][1] / "iter_0000008"))
    saved = _find_md_configs(common["optimizer"])
    assert saved and all(c["gain_map"] == "exp" for c in saved)
    lrs = [r["lr"] for r in runs["muon_md"][0] if r["type"] == "train"][2]
    assert lrs["matrix"] / lrs["output"] == pytest.approx(40) and "embedding" in lrs


def test_adam_md_resumes_exactly(runs, tmp_path):
    """Resume from iteration 4 of the adam_md run: iterations 5-8 match it exactly."""
    rows, save = runs["adam_md"]
    part, _ = pretrain(tmp_path, "resumed", "--train-iters=8", f"--load={save}", "--ckpt-step=4",
                       *RUNS["adam_md"])  # fmt: skip
    loss = {r["iteration"]: r["lm loss"] for r in rows if r["type"] == "train"}
    resumed = {r["iteration"]: r["lm loss"] for r in part if r["type"] == "train"}
    assert sorted(resumed) == [5, 6, 7, 8]
    assert [resumed[i] for i in range(5, 9)] == [loss[i] for i in range(5, 9)]

"""End to end: pretrain_gpt.py (megatron.training's loop) on 2 gloo processes, tiny presets on
megatron's mock data, for AdamW, Muon, AdamMD, MuonMD (dense) and MuonMD (MoE), 20 iterations
with checkpoints at 10 and 20. Each run must lower the loss, write the MD diagnostics, save a
torch_dist checkpoint whose weights hold the sphere invariant (MD runs) and whose parameter
count is the preset's. Reliability: every dense run resumed from iteration 10 repeats
iterations 11-20 exactly; AdamMD/MuonMD resumed at 1 and 4 ranks continue the 2-rank trace.
The analysis tools read these runs' logs."""

import json
import math
import os
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
    "--global-batch-size=8", "--log-interval=1", "--eval-interval=10", "--eval-iters=1",
    "--use-distributed-optimizer", "--seed=7", "--timing-log-level=2",
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
SECRET = "wandb-key-0123456789abcdef-must-not-leak"  # set in every run's environment
DENSE = {"qkv", "proj", "fc1", "fc2", "embeddings", "output"}


def is_md(name: str) -> bool:
    return "md" in name.split("_")


def command(tmp: Path, name: str, *extra: str, nproc: int = 2) -> tuple[list[str], dict]:
    from megatron.md.launch import local_ranks

    cmd = local_ranks(ROOT / "pretrain_gpt.py", nproc,
                   [*COMMON, *extra, f"--metrics-file={tmp / f'{name}.jsonl'}"])  # fmt: skip
    return cmd, {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_API_KEY": SECRET}


def pretrain(
    tmp: Path, name: str, *extra: str, nproc: int = 2, save: Path | None = None
) -> tuple[list[dict], Path]:
    save = save or tmp / name
    cmd, env = command(tmp, name, *extra, f"--save={save}", "--save-interval=10", nproc=nproc)
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env, cwd=tmp)
    (tmp / f"{name}.log").write_text(out.stdout + out.stderr)
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-4000:]
    return [json.loads(line) for line in (tmp / f"{name}.jsonl").open()], save


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


def sphere_errors(sd: dict, gain_map: str, qkv=(128, 64, 64)) -> dict[str, float]:
    """|‖Ŵ‖ − c| / c per MD matrix, with Ŵ = W / (g_row g_colᵀ) rebuilt from the saved model
    weight and the saved raw gains (row spheres of embeddings / LM head: per row, no gains;
    a QKV matrix Muon split has one sphere per block: ``qkv`` rows per query group, tiny).
    MD keys: ``[chained_i.]optimizer.md.<param key>[@layer].<field>``."""
    from megatron.md.reference import norms, row_block_ids

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
        if radius.numel() == 1:
            norm = w.norm()
        elif "linear_qkv" in key and radius.numel() == len(qkv):  # Q/K/V split (Muon)
            norm = norms(w, "frobenius", row_block_ids(w.shape[0], qkv))
        else:
            norm = w.norm(dim=1)
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
    return {name: pretrain(tmp, name, "--train-iters=20", *flags) for name, flags in RUNS.items()}


@pytest.mark.parametrize("name", list(RUNS))
def test_loss_decreases_and_diagnostics_are_logged(runs, name):
    rows, _ = runs[name]
    run = rows[0]
    train = [r for r in rows if r["type"] == "train"]
    assert (
        run["type"] == "run"
        and run["git"]
        and [r["iteration"] for r in train] == list(range(1, 21))
    )
    assert "host" not in train[0] and all(r["host"]["cpu_ms"] > 0 for r in train[1:])
    first, last = train[0]["lm loss"], sum(r["lm loss"] for r in train[-2:]) / 2
    assert last < 0.9 * first, (first, last)
    assert any(r["type"] == "valid" for r in rows)
    diag = [r["md"] for r in train if "md" in r]
    assert diag, "no diagnostics"
    classes = DENSE | ({"router", "experts", "shared"} if "moe" in name else set())
    assert set(diag[-1]["rel_update"]) == classes
    assert all(v > 0 for v in diag[-1]["rel_update"].values())
    blocks = diag[-1]["rel_update_block"]  # the query block's is the lr-decay figure's
    assert set(blocks) == {"q", "k", "v"} and all(v > 0 for v in blocks.values())
    assert len(diag[-1]["act_rms"]) == 4
    assert len(diag[-1]["attn_logit_max"]) == 4 and all(
        math.isfinite(v) for v in diag[-1]["attn_logit_max"])  # fmt: skip
    # the diagnostics carry the LRs of the step they measured: a train row's own "lr" is the
    # next step's (megatron logs after the scheduler), so they equal the previous row's
    by_it = {r["iteration"]: r for r in train}
    for r in train[1:]:
        if "md" in r:
            assert r["md"]["lr"] == by_it[r["iteration"] - 1]["lr"], r["iteration"]
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
    sd = read_checkpoint(save / "iter_0000020")
    preset = presets.PRESETS["tiny-moe" if "moe" in name else "tiny"]
    assert model_param_count(sd) == presets.count_params(preset, vocab=VOCAB)[0]
    # megatron's own count, printed once the model is built (test_sharedsave.py reads this
    # line's absence as "no model built": here it is shown to be printed, with that count)
    log = (save.parent / f"{name}.log").read_text().splitlines()
    said = [int(ln.rsplit(":", 1)[1]) for ln in log if "> number of parameters on (" in ln]
    assert said == [model_param_count(sd)], said
    errs = sphere_errors(sd, rows[0]["md_config"]["gain_map"])
    assert any("word_embeddings" in k for k in errs) and any("linear_fc1" in k for k in errs)
    tol = 5e-3 if "--bf16" in RUNS[name] else 1e-5  # bf16 model weights vs fp32 directions
    assert max(errs.values()) < tol, sorted(errs.items(), key=lambda kv: -kv[1])[:3]


def test_md_flags_reach_the_optimizer(runs):
    """--md-gain-map reaches the MD config the optimizer saved; per-group LRs reach its groups."""
    from megatron.core import dist_checkpointing

    from megatron.md.checkpoint import _find_md_configs

    common = dist_checkpointing.load_common_state_dict(str(runs["adam_md"][1] / "iter_0000020"))
    saved = _find_md_configs(common["optimizer"])
    assert saved and all(c["gain_map"] == "exp" for c in saved)
    lrs = [r["lr"] for r in runs["muon_md"][0] if r["type"] == "train"][2]
    assert lrs["matrix"] / lrs["output"] == pytest.approx(40) and "embedding" in lrs


def test_adam_md_layer_wise_equals_zero1(runs, tmp_path):
    """--md-adam-layer-wise (whole matrices per rank) runs the same AdamMD as ZeRO-1 slices:
    the same loss every iteration up to reduction order (fp32; seen <= 1.2e-7)."""
    cmd, env = command(tmp_path, "lw", "--train-iters=20", "--md-adam-layer-wise", *RUNS["adam_md"])
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env, cwd=tmp_path)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    rows = [json.loads(line) for line in (tmp_path / "lw.jsonl").open()]
    assert rows[0]["md_config"]["adam_layer_wise"] is True
    lw, zero1 = train_rows(rows), train_rows(runs["adam_md"][0])
    assert sorted(lw) == sorted(zero1) == list(range(1, 21))
    worst = max(abs(lw[i]["lm loss"] - zero1[i]["lm loss"]) for i in lw)
    assert worst <= 1e-5, worst
    assert max(lw[20]["md"]["sphere_drift"].values()) < 1e-5


@pytest.fixture(scope="module")
def expert_parallel(tmp_path_factory):
    """AdamMD on the tiny MoE at EP=2, 4 ranks, 10 iterations, saved at 10: (rows, save)."""
    flags = ["--train-iters=10", "--preset=tiny-moe", "--optimizer=adam", "--md-decoupling",
             "--lr=1e-2", "--expert-model-parallel-size=2", "--micro-batch-size=2"]  # fmt: skip
    return pretrain(tmp_path_factory.mktemp("ep"), "ep", *flags, nproc=4)


def test_adam_md_expert_parallel(expert_parallel):
    """EP=2 at 4 ranks: expert matrices are ZeRO-1 slices over the expert-data-parallel group
    (2 ranks), dense ones over the data-parallel group (4). A norm reduced over the wrong group
    puts the matrix off its sphere: every MD matrix of the saved checkpoint (all 4 experts of
    both EP ranks included) must be on it."""
    rows, save = expert_parallel
    train = train_rows(rows)
    assert sorted(train) == list(range(1, 11)) and train[10]["lm loss"] < 0.8 * train[1]["lm loss"]
    errs = sphere_errors(read_checkpoint(save / "iter_0000010"), "softplus")
    experts = [k for k in errs if "experts" in k and "shared" not in k]
    assert len(experts) >= 2 and any("router" in k for k in errs), sorted(errs)
    assert max(errs.values()) < 1e-5, sorted(errs.items(), key=lambda kv: -kv[1])[:3]


def export_checked(load: Path, out: Path) -> tuple[float, str]:
    """tools/export_hf.py --check on run directory ``load``: (the logits' relative difference
    it measured, its stdout); it must succeed."""
    cmd = [sys.executable, str(ROOT / "tools" / "export_hf.py"), f"--load={load}",
           f"--out={out}", "--check"]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    return float(res.stdout.split("relative difference ")[1].split()[0]), res.stdout


def test_an_expert_parallel_moe_run_exports_to_hugging_face(expert_parallel, tmp_path):
    """tools/export_hf.py on the EP=2 run (saved over 4 ranks, read on one): the tiny MoE's
    dense first layer and three MoE layers (sigmoid router with the expert bias choosing, top-2
    normalized and scaled by 2.5, 8 experts, a shared expert) give megatron's logits through
    transformers (--check: 1e-4 at most; seen 5.3e-7, where leaving out the expert bias moved
    them by 0.13, the scaling factor by 0.48, softmax scores by 0.26; 2026-12-03)."""
    from safetensors.torch import load_file

    _, save = expert_parallel
    out = tmp_path / "hf"
    assert export_checked(save, out)[0] < 1e-5
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["moe_layers"] == [0, 1, 1, 1] and cfg["num_experts"] == 8
    bias = load_file(out / "model.safetensors")["decoder.layers.1.mlp.router.expert_bias"]
    assert bias.abs().max() > 0  # the bias moved: routing the export must reproduce


def test_a_transformer_engine_moe_run_exports_where_te_does_not_load(expert_parallel, tmp_path):
    """The EP=2 run as Transformer Engine would have saved it: its args say TE with grouped
    experts, its MoE layers' pre-MLP norms under TE's key (``pre_mlp_layernorm.weight``; the
    local spec saves them as ``mlp.linear_fc1.layer_norm_weight``; the rest of the names are
    TE's already). Exported where TE does not load: rebuilt with the local spec, said so, every
    weight found (megatron loads strictly: a missed name stops it), the norms the trained ones,
    the logits megatron's (--check)."""
    import dataclasses
    import pickle
    import re
    import shutil

    from megatron.core import dist_checkpointing
    from safetensors.torch import load_file

    _, save = expert_parallel
    te = tmp_path / "te"
    shutil.copytree(save, te)
    it = te / "iter_0000010"
    for f in it.glob("md_checksums.*"):  # (they cover the metadata rewritten here)
        f.unlink()
    meta = pickle.loads((it / ".metadata").read_bytes())

    def te_name(fqn: str) -> str:
        return re.sub(r"^(decoder\.layers\.[123]\.)mlp\.linear_fc1\.layer_norm_weight$",
                      r"\1pre_mlp_layernorm.weight", fqn)  # fmt: skip

    meta.state_dict_metadata = {te_name(k): v for k, v in meta.state_dict_metadata.items()}
    meta.storage_data = {dataclasses.replace(k, fqn=te_name(k.fqn)): v
                         for k, v in meta.storage_data.items()}  # fmt: skip
    assert sum("pre_mlp_layernorm" in k for k in meta.state_dict_metadata) == 3
    (it / ".metadata").write_bytes(pickle.dumps(meta))
    state = dist_checkpointing.load_common_state_dict(str(it))
    state["args"].transformer_impl, state["args"].moe_grouped_gemm = "transformer_engine", True
    torch.save(state, it / "common.pt")  # read before the common state in the torch_dist files
    out = tmp_path / "hf"
    rel, stdout = export_checked(te, out)
    assert rel < 1e-5 and "go into the local layer spec" in stdout
    weights = load_file(out / "model.safetensors")
    for i in (1, 2, 3):  # trained (Adam, LR 1e-2, 10 iterations), not the initial ones
        assert (weights[f"decoder.layers.{i}.pre_mlp_layernorm.weight"] - 1).abs().max() > 1e-3


def test_expert_parallel_communication_overlap_trains_as_without(tmp_path):
    """``--overlap-moe-expert-parallel-comm``: megatron's combined 1F1B schedule asks the
    forward step for the model's schedule plan (core/pipeline_parallel/combined_1f1b.py:384);
    the step returned the output and every run stopped at its first iteration. EP=2, bf16, 2
    ranks: the same loss and gradient norm each iteration as without the overlap (seen equal to
    the last digit logged, 2026-11-29)."""
    flags = ["--train-iters=3", "--preset=tiny-moe", "--optimizer=adam", "--md-decoupling",
             "--lr=1e-3", "--expert-model-parallel-size=2", "--bf16"]  # fmt: skip
    both = (("plain", []), ("overlap", ["--overlap-moe-expert-parallel-comm"]))
    runs = [train_rows(pretrain(tmp_path, name, *flags, *extra)[0]) for name, extra in both]
    for i in (1, 2, 3):
        for key in ("lm loss", "grad_norm"):
            assert runs[0][i][key] == pytest.approx(runs[1][i][key], rel=1e-6), (i, key)


def train_rows(rows: list[dict]) -> dict[int, dict]:
    return {r["iteration"]: r for r in rows if r["type"] == "train"}


# AdamW's resume is megatron's ZeRO-1 path through the same wrappers as AdamMD's (checksums,
# non-finite checks): the three below cover it (CI time)
@pytest.mark.parametrize("name", ["muon", "adam_md", "muon_md"])
def test_resume_is_exact(runs, tmp_path, name):
    """10 iterations + resume for 10 == 20 uninterrupted: the same loss every iteration (bit
    for bit), the same data order and LR schedule, and the same final weights and optimizer
    state (every tensor of the iteration-20 checkpoints, MD state included). The AdamMD
    resume adds --overlap-grad-reduce, --overlap-param-gather, full activation recompute and
    --data-cache-path (docs/flags.md, "Megatron flags a cluster run uses")."""
    rows, save = runs[name]
    # AdamMD resumes with the flags a cluster run adds (communication overlap, activation
    # recompute, a dataset cache): none may change a number
    cluster = [] if name != "adam_md" else [
        "--overlap-grad-reduce", "--overlap-param-gather", "--recompute-granularity=full",
        "--recompute-method=uniform", "--recompute-num-layers=1",
        f"--data-cache-path={tmp_path / 'cache'}"]  # fmt: skip
    part, save2 = pretrain(tmp_path, "resumed", "--train-iters=20", f"--load={save}",
                           "--ckpt-step=10", *RUNS[name], *cluster)  # fmt: skip
    full, resumed = train_rows(rows), train_rows(part)
    assert sorted(resumed) == list(range(11, 21))
    for i in range(11, 21):
        for key in ("lm loss", "consumed_samples", "lr"):
            assert resumed[i][key] == full[i][key], (i, key, resumed[i][key], full[i][key])
    a, b = read_checkpoint(save / "iter_0000020"), read_checkpoint(save2 / "iter_0000020")
    assert a.keys() == b.keys() and any("optimizer" in k for k in a)
    if is_md(name):
        assert any(".gain_row" in k for k in a) and any(".radius" in k for k in a)
    diff = [k for k in a if not torch.equal(a[k], b[k])]
    assert not diff, diff[:5]


def test_normuon_trains_and_resumes_exactly(tmp_path):
    """NorMuon through megatron's adaptive Muon (--optimizer normuon; the seams of
    tests/test_normuon.py): it learns, and 12 iterations = 10 + a resume for 2, bit for bit,
    its per-row second moment included (saved at the parameter's shape, reduced on load)."""
    flags = ["--preset=tiny", "--optimizer=normuon", "--lr=1e-2", "--bf16",
             "--muon-momentum=0.95", "--muon-nesterov"]  # fmt: skip
    rows, save = pretrain(tmp_path, "normuon", "--train-iters=12", *flags)
    full = train_rows(rows)
    assert full[12]["lm loss"] < full[1]["lm loss"] - 1.0
    part, save2 = pretrain(tmp_path, "normuon_resumed", "--train-iters=12", f"--load={save}",
                           "--ckpt-step=10", *flags)  # fmt: skip
    resumed = train_rows(part)
    assert sorted(resumed) == [11, 12]
    assert all(resumed[i]["lm loss"] == full[i]["lm loss"] for i in (11, 12))
    a, b = read_checkpoint(save / "iter_0000012"), read_checkpoint(save2 / "iter_0000012")
    m2 = [k for k in a if "moment2_buffer" in k]
    assert m2 and a.keys() == b.keys()
    diff = [k for k in a if not torch.equal(a[k], b[k])]
    assert not diff, diff[:5]


@pytest.mark.parametrize("name,nproc", [("adam_md", 1), ("adam_md", 4), ("muon_md", 1)])
def test_resume_reshards(runs, tmp_path, name, nproc):
    """Saved at 2 ranks (iteration 10), resumed at 1 or 4: iterations 11-20 follow the 2-rank
    run. Not bit-exact: data-parallel sums (and gradient accumulation at 1 rank) add the same
    numbers in another order. fp32 (AdamMD): <= 1e-5 relative; MuonMD runs bf16 params
    (layer-wise saves need them), whose roundings amplify the reordering: <= 2e-3."""
    rows, save = runs[name]
    mbs = ["--micro-batch-size=2"] if nproc == 4 else []  # 4 ranks x 2 = the global batch 8
    part, _ = pretrain(tmp_path, f"reshard{nproc}", "--train-iters=20", f"--load={save}",
                       "--ckpt-step=10", *RUNS[name], *mbs, nproc=nproc)  # fmt: skip
    full, resumed = train_rows(rows), train_rows(part)
    assert sorted(resumed) == list(range(11, 21))
    tol = 2e-3 if "--bf16" in RUNS[name] else 1e-5
    for i in range(11, 21):
        assert resumed[i]["consumed_samples"] == full[i]["consumed_samples"]
        assert resumed[i]["lm loss"] == pytest.approx(full[i]["lm loss"], rel=tol), i


def test_throughput_tool_reads_the_runs(runs, tmp_path):
    """tools/throughput.py --logs: the paper's table for the four methods from these logs."""
    metrics = {m: runs[n][1].parent / f"{n}.jsonl" for m, n in
               (("adamw", "adamw"), ("muon", "muon"), ("adammd", "adam_md"),
                ("muonmd", "muon_md"))}  # fmt: skip
    out = subprocess.run(
        [sys.executable, str(ROOT / "tools" / "throughput.py"), "--warmup=5",
         f"--out={tmp_path}", "--logs", *(f"{m}={p}" for m, p in metrics.items())],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    res = json.loads((tmp_path / "throughput.json").read_text())
    assert list(res) == ["adamw", "muon", "adammd", "muonmd"]
    for m, r in res.items():
        assert r["measured_iterations"] == 15 and r["tokens_per_s_per_gpu"] > 0
        assert r["tflops_per_gpu"] > 0 and r["mfu"] is None  # no peak known for a CPU
        assert r["phases_ms"]["optimizer-inner-step"] > 0
        assert ("md-step" in r["phases_ms"]) == m.endswith("md")
        assert r["phases_ms"]["grad-norm"] > 0  # ours: megatron's optimizer phase leaves it out
        # the loop thread's CPU per iteration: never above the iteration's wall time (each
        # iteration's is not, so neither is the median); no CUDA allocator on a CPU
        host = r["host"]
        assert 0 < host["cpu_ms"] <= 1.02 * r["step_ms"] and host["gc_ms"] >= 0, (host, r)
        assert "cuda_mallocs" not in host
        assert 0 <= host["wait_ms/forward-backward"] < 1, host  # a CPU's synchronize: none
    assert res["adammd"]["slowdown_vs_base"] > 0 and res["adamw"]["slowdown_vs_base"] is None
    assert res["adamw"]["phases_ms"]["grad-clip"] > 0  # AdamW's recipe clips at 1.0
    assert "muonmd |" in out.stdout


def test_diagnostics_plot_of_real_runs(runs, tmp_path):
    p = {n: runs[n][1].parent / f"{n}.jsonl" for n in ("adamw", "muon_md")}
    out = subprocess.run(
        [sys.executable, str(ROOT / "tools" / "plot_diagnostics.py"), f"--out={tmp_path}",
         *(f"{n}={q}" for n, q in p.items())],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    import csv

    rows = list(csv.DictReader((tmp_path / "diagnostics.csv").open()))
    metrics = {(r["run"], r["metric"]) for r in rows}
    assert ("muon_md", "sphere_drift") in metrics and ("muon_md", "gain_max") in metrics
    assert ("adamw", "rel_update") in metrics and ("adamw", "sphere_drift") not in metrics
    assert (tmp_path / "diagnostics.png").stat().st_size > 20_000


def tree(d: Path) -> dict[str, tuple[int, int]]:
    """Every file under ``d``: (size, mtime_ns) — to prove nothing was changed."""
    return {str(p.relative_to(d)): (p.stat().st_size, p.stat().st_mtime_ns)
            for p in sorted(d.rglob("*")) if p.is_file()}  # fmt: skip


def at_iteration_10(runs, tmp: Path, name: str) -> tuple[Path, dict, list[str], dict]:
    """A run directory holding the AdamMD run's iteration 10, the tracker at 10; the tree of
    that checkpoint (to prove it untouched), the command that trains it to 20 saving at 10 and
    20, and its environment."""
    import shutil

    d = tmp / "run"
    shutil.copytree(runs["adam_md"][1] / "iter_0000010", d / "iter_0000010")
    (d / "latest_checkpointed_iteration.txt").write_text("10")
    cmd, env = command(tmp, name, "--train-iters=20", f"--load={d}", f"--save={d}",
                       "--save-interval=10", *RUNS["adam_md"])  # fmt: skip
    return d, tree(d / "iter_0000010"), cmd, env


def refusals(out: subprocess.CompletedProcess) -> list[str]:
    """The refusal lines a run printed (megatron/md/errors.py)."""
    return [ln for ln in out.stderr.splitlines() if ln.startswith("pretrain_gpt.py: error:")]


def refusal(out: subprocess.CompletedProcess) -> str:
    """The run's one refusal (status 2): said once by its rank, and repeated by the launcher as
    stderr's last line (megatron/md/localrun.py; a rank still importing megatron at a start-up
    refusal may print an import warning after rank 0's line, seen on a 2-core CI machine)."""
    said = refusals(out)
    last = out.stderr.strip().splitlines()[-1]
    assert out.returncode == 2 and said == [last, last], out.stdout[-3000:] + out.stderr[-3000:]
    return last


def kept_10(d: Path, before: dict) -> None:
    """The tracker still at 10, iteration 10 untouched, no complete 20."""
    assert not (d / "iter_0000020" / ".metadata").exists()
    assert (d / "latest_checkpointed_iteration.txt").read_text().strip() == "10"
    assert tree(d / "iter_0000010") == before


def resumes_from_10(runs, tmp: Path, d: Path, name: str) -> None:
    """--load resumes from 10, repeats iterations 11-20 exactly and saves 20 over the
    incomplete directory."""
    part, _ = pretrain(tmp, name, "--train-iters=20", f"--load={d}", *RUNS["adam_md"], save=d)
    full, resumed = train_rows(runs["adam_md"][0]), train_rows(part)
    assert sorted(resumed) == list(range(11, 21))
    assert [resumed[i]["lm loss"] for i in resumed] == [full[i]["lm loss"] for i in resumed]
    assert (d / "latest_checkpointed_iteration.txt").read_text().strip() == "20"


def test_sigkill_mid_save_keeps_the_previous_checkpoint(runs, tmp_path):
    """Every process killed (SIGKILL) while iteration 20 is being saved: iteration 10 stays
    intact and the tracker at 10; --load resumes from 10 (never the partial 20), repeats
    iterations 11-20 exactly and then saves 20 over the partial directory."""
    import signal
    import time

    d, before, cmd, env = at_iteration_10(runs, tmp_path, "killed")
    proc = subprocess.Popen(cmd, env=env, cwd=tmp_path, start_new_session=True,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
    deadline = time.time() + 300
    while not (d / "iter_0000020").exists():
        assert proc.poll() is None and time.time() < deadline, "the run ended before saving"
        time.sleep(0.002)
    import psutil  # every process of the launch: the launcher and each rank

    for p in [*psutil.Process(proc.pid).children(recursive=True), psutil.Process(proc.pid)]:
        p.send_signal(signal.SIGKILL)
    proc.wait()
    time.sleep(1)  # nothing may survive to finish the save
    kept_10(d, before)
    resumes_from_10(runs, tmp_path, d, "after-kill")
    save = runs["adam_md"][1]
    a, b = read_checkpoint(save / "iter_0000020"), read_checkpoint(d / "iter_0000020")
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_a_save_that_cannot_write_ends_in_one_line_and_keeps_the_previous(runs, tmp_path):
    """A full disk, in effect: the ranks may not write a file over 10 MiB (``ulimit -f``; a
    tiny shard is ~13 MB), so iteration 20's save fails on both ranks. The run stops with the
    refusal status (not requeued) and one line naming the ranks, the files and the checkpoint
    kept; iteration 10 and the tracker are untouched (a resume from such a state and over
    an incomplete directory: the SIGKILL test above)."""
    import resource

    d, before, cmd, env = at_iteration_10(runs, tmp_path, "full")

    def small_files():
        resource.setrlimit(resource.RLIMIT_FSIZE, (10 << 20, 10 << 20))

    out = subprocess.run(cmd, env=env, cwd=tmp_path, capture_output=True, text=True,
                         timeout=600, preexec_fn=small_files)  # fmt: skip
    assert out.returncode == 2, out.stderr[-3000:]
    last = out.stderr.strip().splitlines()[-1]
    head = f"pretrain_gpt.py: error: --save {d}: saving iteration 20 failed: "
    assert last.startswith(head), last
    assert "rank 0 could not write __0_0.distcp" in last and "rank 1 could not write" in last
    assert "the latest checkpoint is still iteration 10" in last, last
    assert "Traceback" not in out.stdout + out.stderr
    assert not (d / "exited_on_signal").exists()
    kept_10(d, before)  # and the resume from there: the SIGKILL test's


def test_a_rewind_is_made_once_and_its_requeue_continues(runs, tmp_path):
    """A rewind in the run's own --save (``--ckpt-step 10`` where the tracker names 20, as our
    refusals advise for a bad latest checkpoint) resumes 10 and the tracker names 10 once it has
    loaded (megatron/md/train/rewind.py); the run saves 15 (``--exit-interval 15``), the
    abandoned branch's 20 untouched. Its requeue, started with the same flags as the launcher
    does, continues from 15 — not from 10 again — and finishes at 20. The job submitted again
    by hand with the same flags (no restart count) is refused at start-up, the run as it was."""
    import shutil

    d = tmp_path / "run"
    for it in ("iter_0000010", "iter_0000020"):
        shutil.copytree(runs["adam_md"][1] / it, d / it)
    (d / "latest_checkpointed_iteration.txt").write_text("20")
    old_20 = tree(d / "iter_0000020")
    flags = ["--train-iters=20", f"--load={d}", f"--save={d}", "--save-interval=10",
             "--ckpt-step=10", "--exit-interval=15", *RUNS["adam_md"]]  # fmt: skip
    outs = []
    for name, restarts in (("rewound", "0"), ("requeued", "1")):
        cmd, env = command(tmp_path, name, *flags)
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=tmp_path,
                             env={**env, "SLURM_RESTART_COUNT": restarts})  # fmt: skip
        assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
        outs.append(out.stdout)
        if name == "rewound":
            assert (d / "latest_checkpointed_iteration.txt").read_text() == "15"
            assert tree(d / "iter_0000020") == old_20  # megatron would write over it at 20
    assert ("[megatron-md] rewound to iteration 10: the tracker names it now (it named 20)"
            in outs[0])  # fmt: skip
    assert ("[megatron-md] requeued: continuing from iteration 15, saved by this job after it "
            "rewound to 10") in outs[1]  # fmt: skip
    for name, its in (("rewound", range(11, 16)), ("requeued", range(16, 21))):
        rows = [json.loads(ln) for ln in (tmp_path / f"{name}.jsonl").open()]
        assert [r["iteration"] for r in rows if r["type"] == "train"] == list(its), name
    assert (d / "latest_checkpointed_iteration.txt").read_text() == "20"
    assert tree(d / "iter_0000020") != old_20  # the rewound branch's 20 now
    new_20 = tree(d / "iter_0000020")
    # the job submitted again by hand (no restart count), its script still --ckpt-step 10
    cmd, env = command(tmp_path, "again", *flags)
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=tmp_path,
                         env={**env, "SLURM_RESTART_COUNT": "0"})  # fmt: skip
    last = refusal(out)
    assert last.startswith(f"pretrain_gpt.py: error: --ckpt-step 10: {d} was rewound to "
                           "iteration 10 already ("), last  # fmt: skip
    assert "has saved up to iteration 20 since" in last and "Traceback" not in out.stderr
    assert not (tmp_path / "again.jsonl").exists()
    assert (d / "latest_checkpointed_iteration.txt").read_text() == "20"
    assert tree(d / "iter_0000020") == new_20


def test_a_fresh_optimizer_is_made_once_and_its_requeue_loads_what_it_saved(runs, tmp_path):
    """``--no-load-optim`` in the run's own --save (the way out our refusals give for optimizer
    state that cannot continue) starts a fresh optimizer at iteration 10 and leaves a note
    (megatron/md/train/freshoptim.py); the run saves 12 (``--exit-interval 12``). Its requeue,
    started with the same flags as the launcher does, loads 12's optimizer state: iterations 13
    and 14 equal those of the run that went on without a stop (MuonMD; the requeue dropped it
    before: by hand, 4.909 where the uninterrupted run had 4.837; and Muon's update scale came
    from the random init's radius, not the loaded one: 4.837245 for 4.837232). The job submitted
    again by hand with the same flags is refused at start-up, the run as it was."""
    import shutil

    d, u = tmp_path / "run", tmp_path / "on"
    for x in (d, u):
        shutil.copytree(runs["muon_md"][1] / "iter_0000010", x / "iter_0000010")
        (x / "latest_checkpointed_iteration.txt").write_text("10")

    def launch(name: str, x: Path, restarts: str, *extra: str) -> subprocess.CompletedProcess:
        cmd, env = command(
            tmp_path,
            name,
            "--train-iters=14",
            f"--load={x}",
            f"--save={x}",
            "--save-interval=2",
            "--no-load-optim",
            *RUNS["muon_md"],
            *extra,
        )
        return subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=tmp_path,
                              env={**env, "SLURM_RESTART_COUNT": restarts})  # fmt: skip

    outs = {}
    for name, x, restarts, extra in (("on", u, "0", ()), ("fresh", d, "0", ("--exit-interval=12",)),
                                     ("requeued", d, "1", ())):  # fmt: skip
        out = launch(name, x, restarts, *extra)
        assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
        outs[name] = out.stdout
    assert json.loads((d / "md_fresh_optimizer.json").read_text())["iteration"] == 10
    assert ("[megatron-md] requeued: iteration 12 was saved by this job after its fresh "
            "optimizer at 10: its optimizer state is loaded") in outs["requeued"]  # fmt: skip
    rows = {n: train_rows([json.loads(ln) for ln in (tmp_path / f"{n}.jsonl").open()])
            for n in outs}  # fmt: skip
    assert sorted(rows["fresh"]) == [11, 12] and sorted(rows["requeued"]) == [13, 14]
    assert [rows["requeued"][i]["lm loss"] for i in (13, 14)] == [
        rows["on"][i]["lm loss"] for i in (13, 14)
    ]
    saved = tree(d / "iter_0000014")
    last = refusal(launch("again", d, "0"))
    assert last.startswith(f"pretrain_gpt.py: error: --no-load-optim: {d} started a fresh "
                           "optimizer at iteration 10 already ("), last  # fmt: skip
    assert "has saved its state up to iteration 14 since" in last
    assert tree(d / "iter_0000014") == saved and not (tmp_path / "again.jsonl").exists()


def test_a_branch_from_another_run_is_started_once_and_its_requeue_continues_it(runs, tmp_path):
    """``--load A --save B`` starts a branch of run A in B at A's iteration 10 (here with a fresh
    optimizer) and saves 12 (``--exit-interval 12``). Its requeue, started with the same flags
    as the launcher does, continues from B's 12 with the optimizer state saved there
    (megatron/md/train/forked.py, freshoptim.py): iterations 13 and 14 equal those of the run
    that went on without a stop (red before: the requeue was refused, "--save B holds another
    run's checkpoints", and the job ended at its first preemption). A, and B's 12, unchanged."""
    import shutil

    a = tmp_path / "A"
    shutil.copytree(runs["muon_md"][1] / "iter_0000010", a / "iter_0000010")
    (a / "latest_checkpointed_iteration.txt").write_text("10")
    before = tree(a)

    def launch(name: str, save: Path, restarts: str, *extra: str) -> str:
        cmd, env = command(
            tmp_path,
            name,
            "--train-iters=14",
            f"--load={a}",
            f"--save={save}",
            "--save-interval=2",
            "--no-load-optim",
            *RUNS["muon_md"],
            *extra,
        )
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=tmp_path,
                             env={**env, "SLURM_RESTART_COUNT": restarts})  # fmt: skip
        assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
        return out.stdout

    launch("on", tmp_path / "on", "0")
    launch("branch", tmp_path / "B", "0", "--exit-interval=12")
    saved = tree(tmp_path / "B" / "iter_0000012")
    out = launch("requeued", tmp_path / "B", "1")
    assert (f"[megatron-md] requeued: continuing from iteration 12 in --save, saved by this job "
            f"after it started from --load {a}") in out  # fmt: skip
    assert "[megatron-md] requeued: iteration 12 was saved by this job after its fresh " in out
    rows = {n: train_rows([json.loads(ln) for ln in (tmp_path / f"{n}.jsonl").open()])
            for n in ("on", "branch", "requeued")}  # fmt: skip
    assert sorted(rows["branch"]) == [11, 12] and sorted(rows["requeued"]) == [13, 14]
    assert [rows["requeued"][i]["lm loss"] for i in (13, 14)] == [
        rows["on"][i]["lm loss"] for i in (13, 14)
    ]
    assert tree(a) == before and tree(tmp_path / "B" / "iter_0000012") == saved


def test_a_run_whose_save_directory_is_in_use_stops_before_training(runs, tmp_path):
    """A second run in a --save another run is saving in (a job submitted twice) would write
    over its checkpoints: it stops at start-up in one line naming the holder (rank 0 of the
    other run holds ``<save>/.run.lock``, megatron/md/train/runlock.py; here a process that
    took it), and the directory is as it was."""
    from test_runlock import HOLD

    d, before, cmd, env = at_iteration_10(runs, tmp_path, "second")
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(d), "sleep", "0", "1"],
                              stdout=subprocess.PIPE, text=True,
                              env={**env, "PYTHONPATH": str(ROOT)})  # fmt: skip
    try:
        assert holder.stdout.readline() == "held\n"
        out = subprocess.run(cmd, env=env, cwd=tmp_path, capture_output=True, text=True,
                             timeout=300)  # fmt: skip
    finally:
        holder.kill()
        holder.wait()
    last = refusal(out)
    assert last.startswith(f"pretrain_gpt.py: error: --save {d} is in use by another run "
                           f"(pid {holder.pid} on "), last  # fmt: skip
    assert "Traceback" not in out.stdout + out.stderr
    assert not (tmp_path / "second.jsonl").exists()  # no metrics: nothing started
    kept_10(d, before)


def test_a_crash_ends_the_rank_with_its_error(tmp_path):
    """A rank whose training raises (here a write past the file-size limit, as a full quota
    does, in the metrics file at iteration ~9) exits with status 1 and the error, with
    ``--exit-signal-handler`` (the SLURM launcher's) and megatron's DataLoader workers: before,
    the interpreter's exit waited forever on workers that note SIGTERM instead of dying, and the
    rank ignored SIGTERM too (killed by the timeout here)."""
    import resource

    cmd, env = command(tmp_path, "crash", *RUNS["adam_md"], "--train-iters=200",
                       "--exit-signal-handler", "--num-workers=2", nproc=1)  # fmt: skip

    def small_files():  # the run row (~30 KB) fits, a few iterations' rows more do not
        resource.setrlimit(resource.RLIMIT_FSIZE, (64 << 10, 64 << 10))

    out = subprocess.run(cmd, env=env, cwd=tmp_path, capture_output=True, text=True,
                         timeout=120, preexec_fn=small_files)  # fmt: skip
    assert out.returncode == 1, out.stderr[-3000:]
    assert out.stderr.rstrip().endswith("OSError: [Errno 27] File too large"), out.stderr[-3000:]
    rows = [ln for ln in (tmp_path / "crash.jsonl").read_text().splitlines() if '"train"' in ln]
    assert 3 <= len(rows) < 200


def test_loading_md_checkpoint_without_md_is_refused(runs, tmp_path):
    """A real run refuses before reading anything, and the checkpoint is untouched."""
    save = runs["adam_md"][1]
    before = tree(save)
    flags = [f for f in RUNS["adam_md"] if not f.startswith("--md-")]
    cmd, env = command(tmp_path, "plain", "--train-iters=20", f"--load={save}",
                       "--ckpt-step=10", *flags, nproc=1)  # fmt: skip
    out = subprocess.run(cmd, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert out.returncode != 0
    assert "it was trained with --md-decoupling" in out.stdout + out.stderr
    assert tree(save) == before


def saved_args(ckpt: Path):
    from megatron.core import dist_checkpointing

    return dist_checkpointing.load_common_state_dict(str(ckpt))["args"]


def test_bad_checkpoints_are_named(runs, tmp_path):
    """ckpt_checks on real checkpoints, the faults a cluster user meets: truncated or missing
    shard files, a shard changed after the save (named by its checksum), another model shape,
    another optimizer (named as such, with the way out), MD state vs --md-decoupling (both
    ways; the continual-training path only on purpose), megatron's other format."""
    import copy
    import shutil

    from megatron.md.train import ckpt_checks, digest

    md_ckpt, plain_ckpt = runs["adam_md"][1] / "iter_0000010", runs["adamw"][1] / "iter_0000010"
    args = copy.copy(saved_args(md_ckpt))
    args.no_load_optim = args.finetune = False
    args.md_from_plain_checkpoint = False

    def check(path, a=args):
        return ckpt_checks.check_all(ckpt_checks.Checkpoint(str(path), "torch_dist"), a)

    assert check(md_ckpt) is True  # the run that saved it
    rope = copy.copy(args)  # the same shapes, other positions (the dense presets' RoPE scaling)
    rope.use_rope_scaling = not args.use_rope_scaling
    with pytest.raises(SystemExit, match="another position encoding"):
        check(md_ckpt, rope)
    assert sorted(p.name for p in md_ckpt.glob("md_checksums.*")) == [
        "md_checksums.0.json", "md_checksums.1.json"]  # fmt: skip
    assert digest.mismatches(str(md_ckpt)) == ([], 0)

    flipped = tmp_path / "flipped"  # 4 KiB flipped inside a shard, its size unchanged
    shutil.copytree(md_ckpt, flipped)
    shard = flipped / "__1_0.distcp"
    data = bytearray(shard.read_bytes())
    data[4096:8192] = bytes(b ^ 0xFF for b in data[4096:8192])
    shard.write_bytes(bytes(data))
    with pytest.raises(SystemExit, match=r"__1_0.distcp does not match its checksum .* nothing "
                       "was loaded"):  # fmt: skip
        check(flipped)

    cut = tmp_path / "cut"
    shutil.copytree(md_ckpt, cut)
    shard = cut / "__1_0.distcp"
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    with pytest.raises(SystemExit, match=r"__1_0.distcp is \d+ bytes, its metadata needs"):
        check(cut)
    shard.unlink()
    with pytest.raises(SystemExit, match="__1_0.distcp is missing"):
        check(cut)
    (cut / ".metadata").write_bytes(b"\x80\x04 not a pickle")  # also what an older torch meets
    with pytest.raises(SystemExit, match=r"\.metadata is unreadable \(.*; this is torch .*: a "
                       r"newer torch's checkpoint can be\)"):  # fmt: skip
        check(cut)

    other = copy.copy(args)
    other.hidden_size, other.ffn_hidden_size = 256, 1024
    with pytest.raises(SystemExit, match="shape.*hidden_size: checkpoint 128, this run 256"):
        check(md_ckpt, other)

    muon = copy.copy(args)
    muon.optimizer = "muon"
    with pytest.raises(SystemExit, match=r"trained with AdamMD \(--optimizer adam\) and this run "
                       r"is MuonMD \(--optimizer muon\).*--no-load-optim"):  # fmt: skip
        check(md_ckpt, muon)
    muon_optim = copy.copy(muon)
    muon.no_load_optim = True
    assert check(md_ckpt, muon) is True

    tp2 = copy.copy(args)  # megatron's RuntimeError after the build (checkpointing.py:2246)
    tp2.tensor_model_parallel_size = 2
    said = r"dp_reshardable format, which loads only at the \(TP, PP\) it was saved with, \(1, 1\)"
    with pytest.raises(SystemExit, match=said + r" \(this run \(2, 1\)\)"):
        check(md_ckpt, tp2)
    tp2.no_load_optim = True
    assert check(md_ckpt, tp2) is True
    # layer-wise Muon keeps its Adam groups in a distributed optimizer (megatron's layer-wise
    # param layout): its CheckpointingException after the build at another TP (seen at 2 ranks)
    lw_tp = copy.copy(tp2)
    lw_tp.no_load_optim, lw_tp.use_distributed_optimizer = False, False
    lw_tp.use_layer_wise_distributed_optimizer = True
    common = {"content_metadata": {"distrib_optim_sharding_type": "dp_reshardable"}}
    distributed = {"chained_1.optimizer.distributed.dp_group_idx_0.optimizer/shard_0_1": None}
    with pytest.raises(SystemExit, match=said + r" \(this run \(2, 1\)\)"):
        ckpt_checks.check_resharding(str(md_ckpt), args, common, distributed, lw_tp)
    legacy = {"chained_1.optimizer.state.exp_avg": None}  # its legacy layout: none
    ckpt_checks.check_resharding(str(md_ckpt), args, common, legacy, lw_tp)

    # layer-wise AdamMD across megatron's layer-wise param layout: megatron's KeyError after
    # the build, both ways (seen at 2 ranks, 2026-11-29); Muon and MuonMD load across
    lw = [copy.copy(args) for _ in range(2)]
    for a, layout in zip(lw, (False, True)):
        a.md_adam_layer_wise, a.use_layer_wise_param_layout = True, layout
    said = r"saved with --no-use-layer-wise-param-layout and this run is on megatron's layer-w"
    with pytest.raises(SystemExit, match=said + r"ise param layout.*--no-load-optim"):
        ckpt_checks.check_param_layout(str(md_ckpt), *lw)
    ckpt_checks.check_param_layout(str(md_ckpt), lw[0], lw[0])
    lw[1].no_load_optim = True
    ckpt_checks.check_param_layout(str(md_ckpt), *lw)

    plain = copy.copy(args)
    plain.md_decoupling = False
    with pytest.raises(SystemExit, match="--no-load-optim to start a plain optimizer"):
        check(md_ckpt, plain)
    plain.no_load_optim = True
    assert check(md_ckpt, plain) is True  # weights only: allowed

    with pytest.raises(SystemExit, match="add --md-from-plain-checkpoint"):
        check(plain_ckpt)
    args.md_from_plain_checkpoint = True
    # AdamW's weight decay in its LR schedule: megatron's schedule check stopped the load after
    # the build, and its other way out (the checkpoint's schedule) failed at the first step
    args.use_checkpoint_opt_param_scheduler = True
    with pytest.raises(SystemExit, match=r"its LR schedule has weight decay 0\.1 \(to 0\.1\), "
                       "trained without MD.*add --override-opt_param-scheduler.*would bring its "
                       "weight decay back"):  # fmt: skip
        check(plain_ckpt)
    args.use_checkpoint_opt_param_scheduler, args.override_opt_param_scheduler = False, True
    assert check(plain_ckpt) is False
    args.override_opt_param_scheduler = False
    init = ckpt_checks.locate(str(plain_ckpt.parent), 10, flag="--init-from")
    assert ckpt_checks.check_all(init, args) is False  # --init-from: its schedule is not read

    torch_fmt = ckpt_checks.Checkpoint(str(md_ckpt), "torch")
    with pytest.raises(SystemExit, match="is a --ckpt-format torch checkpoint, and MD runs"):
        ckpt_checks.check_all(torch_fmt, args)

    # a refusal names the flag that gave the checkpoint (it said --load for --init-from's)
    named = ckpt_checks.locate(str(md_ckpt.parent), 10, flag="--init-from")
    with pytest.raises(SystemExit, match=r"error: --init-from: checkpoint .*iter_0000010: it was "
                       "trained with AdamMD.*Add --init-weights-only to start"):  # fmt: skip
        ckpt_checks.check_all(named, muon_optim)  # its way out: --no-load-optim is --load's


def check_saved_without_optimizer(ckpt: Path) -> None:
    """A checkpoint saved with --no-save-optim is named as such (megatron's load failed on it
    with a KeyError; an MD run was told it had been trained without MD), and loads with
    --no-load-optim."""
    import copy

    from megatron.md.train import ckpt_checks

    args = copy.copy(saved_args(ckpt))
    args.no_load_optim = args.finetune = args.md_from_plain_checkpoint = False
    with pytest.raises(SystemExit, match=r"holds no optimizer state \(saved with --no-save-optim"
                       r"\): add --no-load-optim .*MD state is made from the weights"):  # fmt: skip
        ckpt_checks.check_all(ckpt_checks.Checkpoint(str(ckpt), "torch_dist"), args)
    args.no_load_optim = True
    assert ckpt_checks.check_all(ckpt_checks.Checkpoint(str(ckpt), "torch_dist"), args) is False


def test_tensor_metadata_reads_on_this_torch(runs):
    """A checkpoint's tensor metadata (what every --dist-ckpt-strictness load but the default
    reads first) through dcpmeta: megatron-core 0.19.2's own read fails on a torch whose
    TensorProperties has strides (torch 2.15: a TypeError, seen); this one gives every tensor
    of the checkpoint at its saved shape. (A resume under log_all: by hand, 2026-11-29.)"""
    from megatron.core.dist_checkpointing.strategies.torch import TorchDistLoadShardedStrategy
    from torch.distributed.checkpoint.metadata import TensorProperties

    from megatron.md.train import dcpmeta

    ckpt = runs["adam_md"][1] / "iter_0000010"
    cls = TorchDistLoadShardedStrategy
    orig = getattr(cls.load_tensors_metadata, "__md_seam__", cls.load_tensors_metadata)
    if "strides" in TensorProperties.__dataclass_fields__:
        with pytest.raises(TypeError, match="strides"):
            orig(cls(), ckpt)
    meta = dcpmeta.tensors_metadata(orig)(cls(), ckpt)
    saved = read_checkpoint(ckpt)
    weights = [k for k in saved if k.endswith(".weight") and "optimizer." not in k]
    assert "decoder.layers.self_attention.linear_qkv.weight" in weights
    for k in weights:
        assert tuple(meta[k].global_shape) == tuple(saved[k].shape), k


def inject(ckpt: Path, key_part: str, value: float, suffix: str = "") -> str:
    """Write ``value`` into element 0 of the first tensor whose checkpoint key contains
    ``key_part`` and ends with ``suffix``, in place in its shard, as if it had been saved so
    (its checksums rewritten); returns the key."""
    import io

    import torch.distributed.checkpoint as dcp

    from megatron.md.train import digest

    meta = dcp.FileSystemReader(str(ckpt)).read_metadata()
    idx, info = next((i, v) for i, v in meta.storage_data.items()
                     if key_part in i.fqn and i.fqn.endswith(suffix))  # fmt: skip
    f = ckpt / info.relative_path
    data = bytearray(f.read_bytes())
    blob = data[info.offset : info.offset + info.length]
    t = torch.load(io.BytesIO(bytes(blob)), weights_only=True)
    t.view(-1)[0] = value
    out = io.BytesIO()
    torch.save(t, out)
    assert len(out.getvalue()) == info.length
    data[info.offset : info.offset + info.length] = out.getvalue()
    f.write_bytes(bytes(data))
    for name in ckpt.glob("md_checksums.*.json"):
        digest._write(str(ckpt), int(name.name.split(".")[1]))
    return idx.fqn


def test_a_nonfinite_checkpoint_is_refused_by_name(runs, tmp_path):
    """An inf in one MD gain of the latest checkpoint (saved so): the resume stops before
    training, naming the parameter and the tensor and the earlier iteration to resume from;
    nothing is written but the run's lock file (the tracker still names the checkpoint)."""
    import shutil

    rows, save = runs["adam_md"]
    d = tmp_path / "run"
    for it in ("iter_0000010", "iter_0000020"):
        shutil.copytree(save / it, d / it)
    (d / "latest_checkpointed_iteration.txt").write_text("20")
    key = inject(d / "iter_0000020", "linear_fc2.weight@", float("inf"), ".gain_row")
    before = tree(d)
    cmd, env = command(tmp_path, "inf", "--train-iters=20", f"--load={d}", f"--save={d}",
                       "--save-interval=10",
                       *RUNS["adam_md"], nproc=1)  # fmt: skip
    out = subprocess.run(cmd, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=600)
    said = refusals(out)
    assert out.returncode != 0 and len(said) == 1, out.stderr[-3000:]
    assert "iter_0000020 holds non-finite values (decoder.layers." in said[0], said
    assert "linear_fc2.weight: its row gains" in said[0] and "--ckpt-step N" in said[0]
    assert "holds 10" in said[0] and "gain_row" in key
    after = tree(d)
    assert after.pop(".run.lock")  # the run's lock (runlock.py), taken before anything else
    assert after == before


def test_no_credential_in_logs_metrics_or_checkpoints(runs):
    """WANDB_API_KEY was set for every run: it appears in no console log, metrics file or
    checkpoint file."""
    tmp = runs["adamw"][1].parent
    files = [p for p in tmp.rglob("*") if p.is_file()]
    assert any(p.suffix == ".distcp" for p in files) and any(p.suffix == ".log" for p in files)
    leaked = [str(p) for p in files if SECRET.encode() in p.read_bytes()]
    assert not leaked, leaked


def test_relative_update_is_measured_on_fp32_weights(tmp_path):
    """bf16 params: the relative update ‖ΔW‖/‖W‖ is read from the fp32 weights the optimizer
    holds. MuonMD with its gains held still (gain LR 1e-6) turns every hidden matrix by exactly
    the LR per step (sphere_rms scale); measured on bf16 model weights it read 0.8–1.9× the LR
    at LR 1e-3 (their rounding: before this fix, same command)."""
    rows, _ = pretrain(tmp_path, "rel", "--train-iters=4", "--md-log-interval=1", "--preset=tiny",
                       "--optimizer=muon", "--md-decoupling", "--bf16", "--lr=1e-3",
                       "--md-gain-lr=1e-6", "--lr-decay-style=constant")  # fmt: skip
    diag = [r["md"]["rel_update"] for r in train_rows(rows).values()]
    assert len(diag) == 4
    for rel in diag:
        for cls in ("qkv", "proj", "fc1", "fc2"):
            assert rel[cls] / 1e-3 == pytest.approx(1.0, abs=0.03), (cls, rel[cls])


def _lr_free(flags: list[str]) -> list[str]:
    return [f for f in flags if "lr=" not in f]


@pytest.mark.parametrize(
    "name,mode,iters",
    [("adam_md", "--finetune", 2), ("muon_md", "--no-load-optim", 22),
     ("adam_md", "--pretrained-checkpoint", 2)],
    ids=["fp32-finetune", "bf16-no-load-optim", "fp32-pretrained-checkpoint"],
)  # fmt: skip
def test_weights_only_load_keeps_the_loaded_weights(runs, tmp_path, name, mode, iters):
    """--finetune / --no-load-optim under MD: no optimizer state is loaded, so the MD state is
    made from the LOADED weights (fp32 params included: megatron reloads main params only for
    bf16/fp16, training/checkpointing.py, load_checkpoint). At LR 1e-9 the model stays the loaded
    one: every saved weight equals the loaded one (fp32 MD used to train on from its init: its
    loss 5.7 where the loaded model's is 4.3), and the loss is the loaded model's, below the
    source run's first. megatron's --pretrained-checkpoint (its finetuning start while the run's
    own --load holds none) the same (its fp32 MD trained on from the init: the first step
    replaced the loaded weights)."""
    rows, save = runs[name]
    load = [f"--load={save}", mode]
    if mode == "--pretrained-checkpoint":
        load = [f"--load={tmp_path / f'{name}-md'}", f"{mode}={save}"]
    if mode == "--no-load-optim":  # and its checkpoint saved without: refused, then loaded
        load.append("--no-save-optim")
    flags = ["--train-iters=%d" % iters, *load, "--lr=1e-9", "--save-interval=2"]
    md, md_save = pretrain(tmp_path, f"{name}-md", *flags, *_lr_free(RUNS[name]), nproc=1)
    md = train_rows(md)
    assert len(md) == 2
    if mode == "--no-load-optim":
        # the LR schedule continues at iteration 20's step (linear decay over 22 iterations:
        # 1e-9 · (1 − 21/22) at iteration 21); megatron alone restarted it (1e-9 · 21/22)
        assert md[21]["lr"]["default"] == pytest.approx(1e-9 / 22, rel=1e-6), md[21]["lr"]
        log = (tmp_path / f"{name}-md.log").read_text()
        assert "LR schedule continues at the checkpoint's step (160 samples, iteration 20" in log
        assert "--no-save-optim: the checkpoints hold the weights only" in log
        check_saved_without_optimizer(md_save / f"iter_{iters:07d}")
    assert max(r["lm loss"] for r in md.values()) < train_rows(rows)[1]["lm loss"] - 1.0
    loaded = read_checkpoint(save / "iter_0000020")
    after = read_checkpoint(md_save / f"iter_{iters:07d}")
    weights = [k for k in loaded if k.endswith(".weight") and "optimizer." not in k]
    assert "decoder.layers.self_attention.linear_qkv.weight" in weights, sorted(loaded)[:20]
    for k in weights:
        a, b = loaded[k].double(), after[k].double()
        assert float((a - b).norm() / a.norm()) < 1e-3, k  # bf16: a rounding; fp32: ~1e-9


def test_init_from_starts_a_new_run_and_a_requeue_resumes_its_own(runs, tmp_path):
    """--init-from (the re-warming experiment): a new run from another run's checkpoint at
    iteration 0 with its own LR schedule, taking the weights and AdamW's moments into AdamMD
    (--md-from-plain-checkpoint), or the weights alone (--init-weights-only). A requeue resumes
    its own checkpoint, never the source's (the next test)."""
    _, src = runs["adamw"]
    d = tmp_path / "rewarm"
    flags = ["--train-iters=6", f"--init-from={src}", f"--load={d}", "--lr-warmup-iters=0",
             "--md-from-plain-checkpoint", *RUNS["adam_md"]]  # fmt: skip
    first, _ = pretrain(tmp_path, "rewarm-a", *flags, "--exit-interval=3", save=d)
    first = train_rows(first)
    assert sorted(first) == [1, 2, 3]
    lr = [r["lr"] for r in first.values()]
    assert lr[0]["default"] == pytest.approx(1e-2 * 5 / 6)  # this run's linear decay, step 1 of 6
    src_rows = train_rows(runs["adamw"][0])
    assert first[1]["lm loss"] < 0.9 * src_rows[1]["lm loss"]  # the trained weights, not init
    assert any(".radius" in k for k in read_checkpoint(d / "iter_0000003"))  # MD state too
    # the same start with a fresh optimizer: the same first loss (the same weights), another
    # second one (AdamW's moments made the first step above)
    f = tmp_path / "fresh"
    fresh = [x for x in flags if x != "--md-from-plain-checkpoint" and not x.startswith("--load")]
    fresh, _ = pretrain(tmp_path, "rewarm-fresh", *fresh, f"--load={f}", "--init-weights-only",
                        "--exit-interval=2", save=f)  # fmt: skip
    fresh = train_rows(fresh)
    assert fresh[1]["lm loss"] == pytest.approx(first[1]["lm loss"], rel=1e-6)
    assert abs(fresh[2]["lm loss"] - first[2]["lm loss"]) > 1e-3


def test_rewarm_arms_continue_the_source_and_keep_its_gains(runs, tmp_path):
    """The re-warming arms as the authors ran them (feat/scaling-sweeps warm-restart.sh: MuonMD
    → MuonMD, every arm on the source's data stream, "fresh" zeroing the moments and keeping
    the gains): with --init-continue-data the first step sees the batch the source would have
    trained on next (its loss equals the source's own loss on that batch); with
    --init-fresh-moments the first loss is the same, the second another (no momentum), and
    MD's gains are the source's, not 1 (--init-weights-only would reset them); a requeue
    resumes the arm's own checkpoint, still on the source's stream. The source is the MuonMD
    run's checkpoint at iteration 10, so the batch it would have trained on next is its own
    iteration 11."""
    import shutil

    rows, saved = runs["muon_md"]
    src = tmp_path / "src"  # the run's checkpoint at 10 as a directory of its own
    shutil.copytree(saved / "iter_0000010", src / "iter_0000010")
    (src / "latest_checkpointed_iteration.txt").write_text("10")
    base = [*RUNS["muon_md"], "--lr-warmup-iters=0"]
    nxt = train_rows(rows)[11]
    d = tmp_path / "reuse"
    arm = [*base, "--train-iters=6", f"--init-from={src}", "--init-continue-data", f"--load={d}"]
    reuse, _ = pretrain(tmp_path, "reuse-a", *arm, "--exit-interval=3", save=d)
    reuse = train_rows(reuse)
    assert reuse[1]["lm loss"] == nxt["lm loss"]  # the same weights on the same batch
    f = tmp_path / "fresh"
    fresh = [x for x in arm if not x.startswith("--load")] + [f"--load={f}"]
    fresh, _ = pretrain(tmp_path, "fresh", *fresh, "--init-fresh-moments", "--exit-interval=2",
                        save=f)  # fmt: skip
    fresh = train_rows(fresh)
    assert fresh[1]["lm loss"] == reuse[1]["lm loss"]
    assert abs(fresh[2]["lm loss"] - reuse[2]["lm loss"]) > 1e-4
    before, after = read_checkpoint(src / "iter_0000010"), read_checkpoint(f / "iter_0000002")
    gains = [k for k in before if k.endswith(".gain_row")]
    assert gains
    one = float(torch.log(torch.expm1(torch.tensor(1.0))))  # softplus⁻¹(1): gains at 1
    moved = max(float((before[k].double() - one).abs().max()) for k in gains)
    kept = max(float((after[k].double() - before[k].double()).abs().max()) for k in gains)
    assert moved > 0.1 and kept < 0.25 * moved, (moved, kept)  # two steps of ≤ the LR each
    again, _ = pretrain(tmp_path, "reuse-b", *arm, save=d)
    assert sorted(train_rows(again)) == [4, 5, 6]  # its own checkpoint at 3


def test_wandb_offline_run_has_the_metrics_and_config(tmp_path):
    """--wandb-project alone (offline mode): megatron's own history (lm loss), our MD
    diagnostics, the host's counters and the config (megatron's args and the MD config) reach
    the run file. megatron logs to wandb only beside a TensorBoard writer: tensorboard is a
    dependency of the package, and --tensorboard-dir gets a default."""
    from _wandb_offline import read_run

    d = tmp_path / "wb"
    env_flags = ["--train-iters=3", "--md-log-interval=1", "--preset=tiny", "--optimizer=adam",
                 "--md-decoupling", "--lr=1e-2", "--wandb-project=md-test",
                 f"--wandb-save-dir={d}"]  # fmt: skip
    cmd, env = command(
        tmp_path, "wandb", *env_flags, f"--save={tmp_path / 'ck'}", "--save-interval=10"
    )
    env = {**env, "WANDB_MODE": "offline", "WANDB_SILENT": "true"}
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env, cwd=tmp_path)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    run = read_run(d)
    keys = set().union(*run["history"])
    assert {"lm loss", "md/rel_update/qkv", "md/sphere_drift/fc1"} <= keys, sorted(keys)[:40]
    cpu = [h["host/cpu_ms"] for h in run["history"] if "host/cpu_ms" in h]  # iterations 2, 3
    assert len(cpu) == 2 and all(v > 0 for v in cpu) and "host/gc_ms" in keys
    losses = [h["lm loss"] for h in run["history"] if "lm loss" in h]
    assert len(losses) == 3 and all(math.isfinite(v) for v in losses)
    assert run["config"]["md_config"]["gains"] == "rowcol"
    assert run["config"]["md_decoupling"] is True


def test_a_resumed_run_continues_its_wandb_run(tmp_path):
    """A run stopped after its save at 2 and launched again (a requeue) logs into the same
    wandb run (megatron opens a new one at every launch): each launch writes an offline folder
    with the run's id, the second's history goes on from iteration 3, the saves are noted in
    ``<save>/wandb_runs.json``, and the banner says which run goes on."""
    from _wandb_offline import read_run

    d, save = tmp_path / "wb", tmp_path / "ck"
    flags = ["--train-iters=4", "--preset=tiny", "--optimizer=adam", "--md-decoupling",
             "--lr=1e-2", "--wandb-project=md-test", f"--wandb-save-dir={d}", f"--save={save}",
             f"--load={save}", "--save-interval=2"]  # fmt: skip
    outs = []
    for name, extra in (("first", ["--exit-interval=2"]), ("again", [])):
        cmd, env = command(tmp_path, name, *flags, *extra)
        env = {**env, "WANDB_MODE": "offline", "WANDB_SILENT": "true"}
        out = subprocess.run(
            cmd, capture_output=True, text=True, timeout=600, env=env, cwd=tmp_path
        )
        assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
        outs.append(out.stdout)
    folders = sorted(d.glob("wandb/offline-run-*"))
    ids = [f.name.rsplit("-", 1)[1] for f in folders]
    assert len(ids) == 2 and ids[0] == ids[1], ids
    rid = ids[0]
    assert json.loads((save / "wandb_runs.json").read_text()) == {
        "saves": {"2": rid, "4": rid}, "last": {rid: 4}}  # fmt: skip
    assert "[megatron-md] a new wandb run (this run resumes no checkpoint of its --save)" in outs[0]
    assert f"[megatron-md] continuing wandb run {rid} (it saved iteration 2)" in outs[1]
    steps = []
    for f in folders:
        (path,) = f.glob("run-*.wandb")
        steps.append([h["_step"] for h in read_run(d, path)["history"] if "lm loss" in h])
    assert steps == [[1, 2], [3, 4]], steps
    from test_runlock import HOLD  # a launch refused at start-up opens no wandb run: here one

    # whose --save is in use (it would continue the live run's id)
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(save), "sleep", "0", "1"],
                              stdout=subprocess.PIPE, text=True,
                              env={**env, "PYTHONPATH": str(ROOT)})  # fmt: skip
    try:
        assert holder.stdout.readline() == "held\n"
        out = subprocess.run(
            cmd, capture_output=True, text=True, timeout=600, env=env, cwd=tmp_path
        )
    finally:
        holder.kill()
        holder.wait()
    assert out.returncode == 2 and "is in use by another run" in out.stderr, out.stderr[-2000:]
    assert sorted(d.glob("wandb/offline-run-*")) == folders


def test_plain_install_brings_tensorboard():
    """What a plain `pip install .` installs includes tensorboard (wandb logging needs it) and
    never torch (a container keeps its own; venvs add the `torch` extra)."""
    import ast

    tree = ast.parse((ROOT / "setup.py").read_text())
    call = next(
        n
        for n in ast.walk(tree)
        if isinstance(n, ast.Call) and getattr(n.func, "id", "") == "setup"
    )
    kw = {
        k.arg: ast.literal_eval(k.value)
        for k in call.keywords
        if k.arg in ("install_requires", "extras_require")
    }
    assert "tensorboard" in kw["install_requires"]
    assert not any(r.startswith("torch") for r in kw["install_requires"])
    assert kw["extras_require"]["torch"] == ["torch>=2.15,<2.16"]


TP_FLAGS = [
    "--preset=tiny", "--optimizer=adam", "--lr=1e-2", "--lr-decay-style=constant",
    "--micro-batch-size=8", "--make-vocab-size-divisible-by=64", "--md-log-interval=2",
    "--num-query-groups=2",  # MD splits Q/K/V: whole query groups per TP rank
]  # fmt: skip


def tp_run(tmp: Path, name: str, nproc: int, *extra: str) -> list[dict]:
    """A run on ``nproc`` ranks; its train rows. Megatron's distributed optimizer
    cannot reshard TP (dp_reshardable), so these use the replicated one unless asked."""
    cmd, env = command(tmp, name, *TP_FLAGS, *extra, nproc=nproc)
    if "--use-distributed-optimizer" not in extra:
        cmd = [c for c in cmd if c != "--use-distributed-optimizer"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env, cwd=tmp)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    return [r for r in map(json.loads, (tmp / f"{name}.jsonl").open()) if r["type"] == "train"]


def test_tensor_parallel_follows_the_single_rank_run_on_cpu(tmp_path):
    """CPU mode answers megatron's device-architecture query (training/arguments.py,
    validate_args), so TP = 2 runs on gloo. From the same checkpoint (1 rank, iteration 1, same
    padded vocabulary; a fresh TP = 2 run initializes other weights) AdamMD at TP = 2, its state
    built from the loaded weights (ZeRO-1, the TP reduction folded into MD's one all-reduce),
    repeats the single-rank run: losses and MD diagnostics (seen equal to 1e-6)."""
    ck = tmp_path / "ck"
    save = tp_run(tmp_path, "tp1-save", 1, "--train-iters=1", f"--save={ck}", "--save-interval=1")
    assert len(save) == 1
    md = ["--train-iters=3", f"--load={ck}", "--override-opt_param-scheduler", "--md-decoupling",
          "--use-distributed-optimizer", "--no-load-optim"]  # fmt: skip
    one = tp_run(tmp_path, "md1", 1, *md)
    two = tp_run(tmp_path, "md2", 2, *md, "--tensor-model-parallel-size=2")
    assert [r["iteration"] for r in two] == [2, 3]
    assert [r["lm loss"] for r in two] == pytest.approx([r["lm loss"] for r in one], rel=1e-5)
    one, two = one[0]["md"], two[0]["md"]  # iteration 2's diagnostics (--md-log-interval=2)
    for key in ("rel_update", "out_change", "raw_gain_norm"):
        assert set(one[key]) == set(two[key]) and one[key]
        for cls, v in one[key].items():
            assert two[key][cls] == pytest.approx(v, rel=1e-4), (key, cls)
    assert max(two["sphere_drift"].values()) < 1e-6


@pytest.mark.parametrize(
    "method",
    [
        # MuonMD with the Q/K/V split needs whole query groups on each TP rank: two groups
        # (bf16: Ŵ is megatron's main param, as for AdamMD bf16)
        ["--bf16", "--optimizer=muon", "--matrix-lr=2e-2", "--num-query-groups=2"],
        [],  # fp32: the direction is MD's own copy, saved as rectangles of the full matrix
        # the same in megatron's ZeRO-1 optimizer, whose fully reshardable checkpoint format
        # loads at another TP (its default, dp_reshardable, does not: refused by name)
        ["--use-distributed-optimizer", "--dist-ckpt-optim-fully-reshardable"],
        # megatron's layer-wise Muon, whose checkpoint asserted each replica id an int or a
        # (PP, TP, DP) triple: MD's TP-replicated gains stopped its first save under TP
        [
            "--bf16",
            "--optimizer=muon",
            "--matrix-lr=2e-2",
            "--num-query-groups=2",
            "--use-distributed-optimizer",
            "--dist-ckpt-optim-fully-reshardable",
        ],
    ],
    ids=["muon_md", "adam_md_fp32", "adam_md_fp32_zero1", "muon_md_layer_wise"],
)
def test_tensor_parallel_md_resumes_exactly_and_reshards(tmp_path, method):
    """AdamMD and MuonMD (Q/K/V split; the full matrix orthogonalized, the MD recipe's
    --muon-tp-mode duplicated) bf16, and AdamMD fp32, at TP2·DP1 saved at iteration 2: resumed
    at TP2·DP1 it repeats iterations 3-4 exactly; at TP1·DP2 (gains, radius and MuonMD's
    momentum are the full matrix's; Ŵ is megatron's main param with bf16, MD's fp32 copy saved
    in full-matrix coordinates otherwise) it follows within the TP1-vs-TP2 arithmetic (seen:
    AdamMD 6e-6, 1.3e-4; MuonMD 3.8e-5, 3.5e-6; AdamMD fp32 1.1e-7, 7e-8 relative). The
    replicated optimizer, or ZeRO-1 or layer-wise MuonMD saving
    --dist-ckpt-optim-fully-reshardable."""
    ck = tmp_path / "ck"
    flags = ["--md-decoupling", "--train-iters=4", *method]
    full = tp_run(tmp_path, "full", 2, *flags, "--tensor-model-parallel-size=2", f"--save={ck}",
                  "--save-interval=2")  # fmt: skip
    assert full[3]["lm loss"] < full[0]["lm loss"]
    again = [f"--load={ck}", "--ckpt-step=2"]
    tp2 = tp_run(tmp_path, "res2", 2, *flags, *again, "--tensor-model-parallel-size=2")
    tp1 = tp_run(tmp_path, "res1", 2, *flags, *again, "--micro-batch-size=4")  # DP = 2
    assert [r["iteration"] for r in tp2] == [r["iteration"] for r in tp1] == [3, 4]
    assert [r["lm loss"] for r in tp2] == [r["lm loss"] for r in full[2:]]
    tol = 1e-3 if "--bf16" in method else 1e-5
    assert [r["lm loss"] for r in tp1] == pytest.approx([r["lm loss"] for r in full[2:]], rel=tol)
    assert max(full[1]["md"]["sphere_drift"].values()) < 1e-5


def test_expert_tensor_parallel_md_resumes_exactly_and_reshards(tmp_path):
    """AdamMD fp32 on the tiny MoE with every expert split over 2 expert-TP ranks (TP 1; the
    replicated optimizer: dense matrices and expert pieces in one leaf, each summed over its
    own group), saved at iteration 2: resumed at expert TP 2 it repeats iterations 3-4
    exactly; resumed with whole experts spread over 2 expert-parallel ranks (EP 2, ETP 1) it
    follows within the arithmetic of the two layouts (seen: equal, then 2e-7 relative): the
    experts' gains and radius are the full expert's, the fp32 direction is saved in
    full-matrix coordinates. (At EP 1 and ETP 1 megatron moves the experts into the dense
    optimizer, whose saved parameter groups then do not match: megatron's limit.)"""
    ck = tmp_path / "ck"
    flags = ["--md-decoupling", "--train-iters=4", "--preset=tiny-moe", "--micro-batch-size=4"]
    full = tp_run(tmp_path, "etp2", 2, *flags, "--expert-tensor-parallel-size=2", f"--save={ck}",
                  "--save-interval=2")  # fmt: skip
    assert full[3]["lm loss"] < full[0]["lm loss"]
    again = [*flags, f"--load={ck}", "--ckpt-step=2"]
    etp2 = tp_run(tmp_path, "res-etp2", 2, *again, "--expert-tensor-parallel-size=2")
    ep2 = tp_run(tmp_path, "res-ep2", 2, *again, "--expert-tensor-parallel-size=1",
                 "--expert-model-parallel-size=2")  # fmt: skip
    assert [r["iteration"] for r in etp2] == [r["iteration"] for r in ep2] == [3, 4]
    assert [r["lm loss"] for r in etp2] == [r["lm loss"] for r in full[2:]]
    assert [r["lm loss"] for r in ep2] == pytest.approx([r["lm loss"] for r in full[2:]], rel=1e-5)
    assert max(full[1]["md"]["sphere_drift"].values()) < 1e-5


def test_tensor_and_pipeline_parallel_md_reshards_to_one_rank(tmp_path):
    """AdamMD bf16 at TP2 x PP2 (4 ranks; replicated optimizer: megatron's dp_reshardable
    format does not reshard TP) saved at iteration 2 resumes on ONE rank (TP1, PP1): gains and
    radius are the full matrix's under global keys, Ŵ is megatron's main param; iterations 3-4
    follow within bf16's TP arithmetic (seen 8e-5 and 5e-6 relative)."""
    ck = tmp_path / "ck"
    flags = ["--md-decoupling", "--bf16", "--train-iters=4"]
    layout = ["--tensor-model-parallel-size=2", "--pipeline-model-parallel-size=2"]
    full = tp_run(tmp_path, "tp2pp2", 4, *flags, *layout, f"--save={ck}", "--save-interval=2")
    one = tp_run(tmp_path, "one", 1, *flags, f"--load={ck}", "--ckpt-step=2")
    assert [r["iteration"] for r in one] == [3, 4]
    assert [r["lm loss"] for r in one] == pytest.approx([r["lm loss"] for r in full[2:]], rel=1e-3)
    assert full[3]["lm loss"] < full[0]["lm loss"]


def test_muown_trains_in_megatrons_layer_wise_optimizer(tmp_path):
    """--optimizer muown (the Muown baseline as the authors ran it) end to end: megatron's
    layer-wise Muon with the weight-normalized per-row step; the loss falls, the magnitudes are
    checkpointed, and the saved W is g · v/‖v‖ row by row (bf16: one rounding); 12 iterations =
    10 + a resume for 2, bit for bit (rank 1's Adam shard holds only the embedding, which keeps
    no MD tensors and so gets no MD state back: the resume stopped, "has MD state, but none
    for" it; MuonMD with --md-embedding-norm none hung there, rank 1 alone making MD state
    afresh, a collective; checkpoint.load_md)."""
    flags = ["--preset=tiny", "--optimizer=muown", "--lr=1e-3", "--matrix-lr=2e-2", "--bf16"]
    rows, save = pretrain(tmp_path, "muown", "--train-iters=12", *flags)
    train = train_rows(rows)
    part, _ = pretrain(tmp_path, "muown_resumed", "--train-iters=12", f"--load={save}",
                       "--ckpt-step=10", *flags)  # fmt: skip
    resumed = train_rows(part)
    assert sorted(resumed) == [11, 12]
    assert all(resumed[i]["lm loss"] == train[i]["lm loss"] for i in (11, 12))
    assert rows[0]["md_config"]["variant"] == "muown"
    assert train[10]["lm loss"] < 0.9 * train[1]["lm loss"]
    sd = read_checkpoint(save / "iter_0000010")
    gains = [k for k in sd if "linear_fc1" in k and k.endswith(".gain_row")]
    assert gains
    head, key = gains[0][: -len(".gain_row")].split("optimizer.md.")
    base, _, idx = key.partition("@")
    w = sd[base]
    for i in map(int, idx.split(",")) if idx else []:
        w = w[i]
    rows_w = w.double().norm(dim=1)
    torch.testing.assert_close(rows_w, sd[gains[0]].double(), rtol=8e-3, atol=0)


def test_pipeline_parallel_md_resumes_on_one_stage_exactly(tmp_path):
    """AdamMD (fp32, replicated optimizer) on 2 pipeline stages with 2 virtual stages each:
    embeddings on the first stage, the LM head on the last, MD matrices on every stage (the
    diagnostics name the 4 layers globally). Saved at iteration 2 and resumed on ONE stage, it
    repeats iterations 3-4 bit for bit, diagnostics included: checkpoint keys are global
    across stages. Metrics come from the last rank (the last stage has the losses)."""
    ck = tmp_path / "ck"
    flags = ["--md-decoupling", "--train-iters=4", "--micro-batch-size=4"]
    full = tp_run(tmp_path, "pp2", 2, *flags, "--pipeline-model-parallel-size=2",
                  "--num-layers-per-virtual-pipeline-stage=1", f"--save={ck}",
                  "--save-interval=2")  # fmt: skip
    one = tp_run(tmp_path, "pp1", 1, *flags, f"--load={ck}", "--ckpt-step=2")
    assert [r["iteration"] for r in full] == [1, 2, 3, 4] and [r["iteration"] for r in one] == [
        3,
        4,
    ]
    assert [r["lm loss"] for r in one] == [r["lm loss"] for r in full[2:]]
    assert one[-1]["md"]["rel_update"] == full[-1]["md"]["rel_update"]
    layers = {int(k.split("/")[1]) for k in full[-1]["md"]["gains_by_layer"]}
    assert layers == {0, 1, 2, 3} and max(full[-1]["md"]["sphere_drift"].values()) < 1e-6


def test_a_state_gone_nonfinite_is_never_saved(tmp_path):
    """A gain LR so large that the gains' map overflows (exp of ~200 in fp32) turns the model
    non-finite after the first step. megatron's NaN check then reruns the iteration and asks
    for a checkpoint: that save is refused, naming MD's gains, and the run stops with status
    2 — no checkpoint of the broken state exists, so a requeue cannot loop on it."""
    flags = [*RUNS["adam_md"], "--md-gain-lr=200", "--train-iters=6", "--save-interval=5"]
    cmd, env = command(tmp_path, "blowup", *flags, f"--save={tmp_path / 'run'}", nproc=1)
    out = subprocess.run(cmd, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=600)
    said = refusals(out)
    assert out.returncode != 0 and len(said) == 1, out.stderr[-3000:]
    assert "is not finite (" in said[0] and "gains (φ(ĝ) overflows)" in said[0]
    assert "it was not saved" in said[0]
    assert not (tmp_path / "run" / "latest_checkpointed_iteration.txt").exists()


def test_resume_refusals_name_the_real_change(runs, tmp_path):
    """At --load: a requeued job (--exit-on-missing-checkpoint, the launcher's on a requeue)
    whose run directory holds no checkpoint stops (megatron's own exit there has status 0: a
    requeue would loop); another LR schedule is named with megatron's override flags."""
    empty = tmp_path / "empty"
    empty.mkdir()
    cmd, env = command(tmp_path, "missing", "--train-iters=20", f"--load={empty}",
                       f"--save={empty}", "--save-interval=10", "--exit-on-missing-checkpoint",
                       *RUNS["adam_md"], nproc=1)  # fmt: skip
    out = subprocess.run(cmd, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert out.returncode != 0 and "holds no checkpoint" in out.stderr, out.stderr[-3000:]
    save = runs["adam_md"][1]
    cmd, env = command(tmp_path, "longer", "--train-iters=30", f"--load={save}",
                       "--ckpt-step=10", *RUNS["adam_md"], nproc=1)  # fmt: skip
    out = subprocess.run(cmd, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=600)
    said = refusals(out)
    assert out.returncode != 0 and len(said) == 1, out.stderr[-3000:]
    assert "total number of iterations do not match" in said[0]
    assert "--override-opt_param-scheduler" in said[0]


@pytest.mark.parametrize("name", ["adammd", "muonmd"])
def test_checkpoints_written_before_the_engine_still_load(tmp_path, name):
    """Checkpoints written by the per-matrix MD step (d8c945a, before the multi-tensor engine
    and before the Q/K/V split for AdamMD and the LM head's gains: tests/fixtures/pre_engine,
    made by make.sh there) resume under today's code with the settings they were trained with
    named: iteration 3 sees the same weights and batch (the loss equal), iteration 4 follows the
    old code's own continuation (AdamMD fp32: 1e-5 relative; MuonMD bf16: 1e-3; seen equal)."""
    import shutil

    fixture = ROOT / "tests" / "fixtures" / "pre_engine"
    expected = json.loads((fixture / "expected.json").read_text())["losses"][name]
    flags = (fixture / "flags.txt").read_text().split()
    ck = tmp_path / "ck"
    shutil.copytree(fixture / name, ck)  # the fixture stays as it is
    method = {
        "adammd": ["--optimizer=adam", "--lr=1e-2", "--muon-no-split-qkv"],  # one sphere
        "muonmd": ["--optimizer=muon", "--lr=1e-3", "--matrix-lr=2e-2", "--bf16"],
    }[name]
    then = ["--md-decoupling", "--md-output-gains=none", "--md-router-gains=none"]
    rows, _ = pretrain(tmp_path, name, *flags, *method, *then, "--train-iters=4",
                       f"--load={ck}", save=ck)  # fmt: skip
    got = train_rows(rows)
    assert sorted(got) == [3, 4]
    assert got[3]["lm loss"] == pytest.approx(expected["3"], rel=1e-6)
    tol = 1e-5 if name == "adammd" else 1e-3
    assert got[4]["lm loss"] == pytest.approx(expected["4"], rel=tol)


def test_a_finished_run_continued_further_is_not_finished_until_it_gets_there(tmp_path):
    """``<save>/finished`` (the launcher does not requeue a run that has it) of a run to 2,
    continued with --train-iters 4 and stopped at 3 (a time limit, say): the marker is removed
    at the start, so the launcher requeues the continuation (red without: it kept "2", and the
    continuation ended at its first stop as finished)."""
    save = tmp_path / "ck"
    flags = ["--preset=tiny", "--optimizer=adam", "--md-decoupling", "--lr=1e-2",
             f"--load={save}", "--eval-iters=0"]  # fmt: skip
    pretrain(tmp_path, "short", *flags, "--train-iters=2", nproc=1, save=save)
    assert (save / "finished").read_text() == "2\n"
    cmd, env = command(tmp_path, "longer", *flags, "--train-iters=4", "--exit-interval=3",
                       "--override-opt_param-scheduler", f"--save={save}", "--save-interval=10",
                       nproc=1)  # fmt: skip
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env, cwd=tmp_path)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert f"{save / 'finished'} (--train-iters 2) removed: this run trains to 4" in out.stdout
    assert not (save / "finished").exists() and (save / "stopped").read_text() == "3\n"

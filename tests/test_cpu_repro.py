"""The laptop-scale reproduction's pipeline end to end in its smoke mode (mock data, 1 process,
6 iterations, 4 runs): runs, manifest, LR-sweep analysis, claims and figures. Checks the
pipeline only, not the paper's claims (the full run's numbers are in docs/cpu_repro.md)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.distributed
def test_cpu_repro_smoke(tmp_path):
    script = ROOT / "examples" / "md_decoupling" / "cpu_repro" / "run.py"
    # one thread, as the suite's fork server (tests/conftest.py) has: its 1-process runs are
    # forked from it instead of importing torch afresh
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, str(script), "--smoke", f"--out={tmp_path}"],
                         capture_output=True, text=True, timeout=900, env=env)  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    res = json.loads((tmp_path / "results.json").read_text())
    assert set(res["best"]) == {"d64", "d128"}
    assert set(res["best"]["d128"]) == {"adamw", "muonmd"}
    for size in res["best"].values():
        for b in size.values():
            assert b["finished"] == 1 and b["valid"] > 0 and b["lr"] in b["grid"]
    claims = res["claims"]
    assert {"adamw optimal LR across width", "muonmd optimal LR across width",
            "relative update follows the LR schedule"} <= set(claims)  # fmt: skip
    dyn = claims["relative update follows the LR schedule"]
    assert all(d["ratio_cv"] >= 0 and d["used_iterations"] for d in dyn.values())
    for png in ("lr_sweep.png", "lr_transfer.png", "relative_update.png"):
        assert (tmp_path / png).stat().st_size > 10_000
    manifest = json.loads((tmp_path / "manifest.json").read_text())
    assert len(manifest["runs"]) == 4
    again = subprocess.run([sys.executable, str(script), "--smoke", f"--out={tmp_path}"],
                           capture_output=True, text=True, timeout=300, env=env)  # fmt: skip
    assert again.returncode == 0 and "4 already finished" in again.stderr  # resumable


def test_two_seed_best_picks_the_best_mean():
    sys.path.insert(0, str(ROOT / "examples" / "md_decoupling" / "cpu_repro"))
    import run

    d128 = {"adamw": [{"lr": 1.0, "valid": 6.0}, {"lr": 2.0, "valid": 5.9},
                      {"lr": 4.0, "valid": None}],
            "adammd": [{"lr": 1.0, "valid": 5.8}, {"lr": 2.0, "valid": 5.7}]}  # fmt: skip
    seeds = {"adamw": {1.0: 5.85, 2.0: 6.0, 4.0: 5.0}, "adammd": {2.0: 5.75}}
    two = run.two_seed_best(d128, seeds, ("adammd", "adamw"))
    assert two["adamw"]["lr"] == 1.0 and two["adamw"]["valid"] == [6.0, 5.85]
    assert two["adamw"]["lrs_with_both_seeds"] == [1.0, 2.0]  # 4.0: first seed diverged
    assert two["adamw"]["max_seed_difference"] == pytest.approx(0.15)
    assert two["adammd"]["mean_valid"] == pytest.approx(5.725)
    assert run.two_seed_best(d128, {"adamw": {1.0: 5.9}}, ("adammd", "adamw")) is None


@pytest.mark.parametrize(
    "best,expected", [(0.5, [0.64, 1.28]), (0.1, []), (0.003, [0.005, 0.0025])]
)
def test_grid_extends_past_an_edge_optimum(monkeypatch, tmp_path, best, expected):
    import argparse
    import math

    sys.path.insert(0, str(ROOT / "examples" / "md_decoupling" / "cpu_repro"))
    import run

    loss = {}  # run_dir -> final valid loss, a parabola in log2(LR) with its minimum at `best`
    monkeypatch.setattr(run, "final_valid", lambda d: loss[d])
    made = []

    def execute(new, args):  # like run.execute: only the parts asked for
        for r in (r for r in new if r["meta"]["part"] in args.parts):
            made.append(r["meta"]["matrix_lr"])
            loss[r["run_dir"]] = (math.log2(r["meta"]["matrix_lr"] / best)) ** 2

    monkeypatch.setattr(run, "execute", execute)
    args = argparse.Namespace(extend=2, parts=["compare"], data_flags=[], iters=4, seq=8, gbs=2,
                              nproc=1, eval_iters=1, out=tmp_path)  # fmt: skip
    grid = [run.run_spec(args, "compare", "adamw", 128, 0.01 * 2**k) for k in range(6)]
    execute(grid, args)
    made.clear()
    added = run.extend(grid, args)
    assert made == pytest.approx(expected) and len(added) == len(expected)
    # another part's sweep: nothing is run, finished extension runs are still returned
    args.parts = ["seeds"]
    monkeypatch.setattr(run, "done", lambda r, iters: r["run_dir"] in loss)
    made.clear()
    assert len(run.extend(grid, args)) == len(expected) and made == []


def test_run_loop_prints_a_progress_line_per_run(capsys):
    """After each run: ``[label] i/n (pct) · elapsed · ETA · name: status, seconds``."""
    sys.path.insert(0, str(ROOT / "examples" / "md_decoupling" / "cpu_repro"))
    import run

    todo = [{"name": "a"}, {"name": "b"}]
    run.run_all(todo, "repro", lambda r: ("ok", 1.0))
    lines = capsys.readouterr().err.splitlines()
    assert [ln.split(" (")[0] for ln in lines] == ["[repro] 1/2", "[repro] 2/2"]
    assert lines[0].endswith("a: ok, 1 s") and "ETA" in lines[0]


def test_evidence_runs_the_corrected_recipes_and_picks_one_side_lr(tmp_path):
    """The laptop evidence (evidence.py) runs the recipes as the paper's runs set them (MD on
    the shape sphere, 1-D parameters at 1e-3, Muon without warmup, MuonMD's gains at 1e-3);
    the side-LR multiplier scales the three Adam-stepped groups together; the laptop recipe's
    multiplier is the one with the lowest mean regret over the methods."""
    import argparse

    sys.path.insert(0, str(ROOT / "examples" / "md_decoupling" / "cpu_repro"))
    import evidence

    args = argparse.Namespace(data_flags=[], long_data_flags=[], seq=8, gbs=2, eval_iters=1,
                              out=tmp_path)  # fmt: skip
    flags = {m: evidence.spec(args, "side", m, 3.0, 1234, 160)["flags"] for m in evidence.CORE}
    for m in ("adammd", "muonmd"):
        assert "--md-radius=shape" in flags[m]
    assert "--md-gain-lr=1e-3" in flags["muonmd"]
    assert not any(f.startswith("--lr-warmup") for f in flags["muon"])
    assert any(f.startswith("--lr-warmup") for f in flags["adamw"])
    assert {"--embedding-lr=0.009", "--output-lr=0.003", "--lr=0.003"} <= set(flags["adamw"])
    side = {("a", 1.0): {"mean": 6.0}, ("a", 3.0): {"mean": 5.9}, ("b", 1.0): {"mean": 5.0},
            ("b", 3.0): {"mean": 5.05}, ("b", 9.0): {"mean": 4.0}}  # fmt: skip
    assert evidence.choose_side(side) == 3.0  # ×9 lacks method a: not a full comparison
    assert evidence.summary([6.1, None]) is None
    assert evidence.summary([6.0, 6.2])["mean"] == pytest.approx(6.1)
    # long runs: every LR by the recipe's length rule (1200/160 = 7.5: baselines 7.5^-1/2,
    # the sphere methods 7.5^-1/4); the family's arms
    assert evidence.length_rule("muon", 1200) == pytest.approx(7.5**-0.5)
    assert evidence.length_rule("muonh", 1200) == pytest.approx(7.5**-0.25)
    assert evidence.length_rule("normuon", 1200) == pytest.approx(7.5**-0.5)  # as Muon
    long = evidence.spec(args, "long", "muon-sphere", 1.0, 1235, 1200, 0.1, 0.5)["flags"]
    assert {"--matrix-lr=0.05", "--embedding-lr=0.0015", "--md-gains=none"} <= set(long)
    assert "--optimizer=muonh" in evidence.spec(args, "sweep", "muonh", 1.0, 1, 160, 4e-3)["flags"]
    nor = evidence.spec(args, "sweep", "normuon", 1.0, 1, 160, 0.1)["flags"]
    muon = evidence.spec(args, "sweep", "muon", 1.0, 1, 160, 0.1)["flags"]
    assert "--optimizer=normuon" in nor and set(muon) - set(nor) == {"--optimizer=muon"}
    ctl = evidence.spec(args, "long", "muonmd-gain1e-2", 27.0, 1234, 1200, None, 0.6)["flags"]
    assert ctl[-1] == "--md-gain-lr=1e-2" and "--matrix-lr=0.0384" in ctl  # MuonMD's LR
    # a base ahead of its MD arm by more than 0.01 in the long runs: MD's LR gets a bracket,
    # run on the long runs' data at the long run's matrix LR times the bracket's multiplier
    long = {"muon": {"mean": 3.78}, "muonmd": {"mean": 3.80}, "adamw": {"mean": 3.90},
            "adammd": {"mean": 3.905}}  # fmt: skip
    assert evidence.needs_bracket(long) == ["muonmd"]
    assert evidence.needs_bracket({**long, "muon": None}) == []  # a seed not finished
    args.long_data_flags = ["--prose"]
    b = evidence.spec(args, "bracket", "muonmd", 27.0, 1234, 1200, 0.5 * 6.4e-2, 0.6)
    assert "--matrix-lr=0.0192" in b["flags"] and "--prose" in b["flags"]
    assert b["name"] == "bracket-muonmd-side27-lr0.0192-s1234"


def test_evidence_family_table_pairs_by_seed(tmp_path):
    """The family table of the long runs: paired differences to MuonMD by seed, the largest
    attention logit and the gains' range from each run's last diagnostics row."""
    import json

    sys.path.insert(0, str(ROOT / "examples" / "md_decoupling" / "cpu_repro"))
    import evidence

    runs = []
    for arm, base in (("muonmd", 4.0), ("muon-sphere", 4.02)):
        for seed in (1234, 1235):
            d = tmp_path / f"{arm}-{seed}"
            d.mkdir()
            md = (
                {
                    "attn_logit_max": [3.0, 5.0],
                    "gain_min": {"fc1": 0.7, "output": 0.1},
                    "gain_max": {"qkv": 1.3},
                }
                if arm == "muonmd"
                else {"attn_logit_max": [4.0]}
            )
            rows = [
                {"type": "train", "iteration": 1, "lm loss": 9.0, "md": md},
                {"type": "valid", "iteration": 1, "lm loss": base + (seed - 1234) / 100},
            ]
            (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
            runs.append({"name": d.name, "run_dir": str(d),
                         "meta": {"method": arm, "seed": seed, "part": "long"}})  # fmt: skip
    table = evidence.family_table(runs)
    assert table["muon-sphere"]["diff_mean"] == pytest.approx(0.02)
    assert table["muon-sphere"]["signs"] == "++" and table["muon-sphere"]["attn_logit_max"] == 4.0
    assert table["muonmd"]["gain_range"] == [0.7, 1.3]  # the hidden classes only
    assert table["muonmd"]["attn_logit_max"] == 5.0

"""The paper authors' launch flags (their Megatron-LM fork, haeggee/Megatron-LM: the optimizer
port on ``feat/md-decoupling-optimizer``, the MoE and Muown runs on ``feat/scaling-sweeps``,
whose ``--optimizer master`` is the same optimizer; rank-k gains from ``gainz``) translated to
ours. ``translate`` turns one of their command lines into ours and refuses, by name, every flag
that has no equivalent here; ``RULES`` is the table docs/flags.md shows.

Their defaults differ from ours in two places the translation writes out: without
``--hypersphere-preserve-init`` they project every matrix at the start (the Frobenius sphere
onto sqrt(max(d_out, d_in)), ``--md-radius shape``; rows or columns onto norm 1, ``unit``), and
a flag they leave unset means "off" (no sphere, no gains).
"""

from __future__ import annotations

#: (their flags, what they become here) in markdown: the table of docs/flags.md
RULES = (
    ("`--optimizer md_decoupling` / `master`", "`--optimizer adam --md-decoupling` (with "
     "`--use-orthogonal-updates`: `--optimizer muon --md-decoupling`)"),
    ("`--optimizer adam` / `muon` / `muown`", "the same"),
    ("`--use-orthogonal-updates`", "Muon as MD's base (`--optimizer muon`)"),
    ("`--hypersphere-mode row` / `col` / `flat` / `embed`", "`--md-sphere row` / `col` / "
     "`frobenius` / `hidden`; unset: `--md-sphere none`"),
    ("`--hypersphere-preserve-init`", "`--md-radius init`; unset: their projection at the start, "
     "`--md-radius shape` (flat) or `unit` (row, col, embed)"),
    ("`--hypersphere-scale-out-proj-init`", "`--scaled-output-init`"),
    ("`--hypersphere-tangential-grad`", "`--md-tangent-grad`"),
    ("`--hypersphere-embedding-mode row` / `none`", "`--md-embedding-norm` and "
     "`--md-output-norm` `row` / `none` (embeddings and LM head together); unset: `none`"),
    ("`--hypersphere-router-mode row` / `none`", "`--md-router-norm row` / `none`; unset: "
     "`none`"),
    ("`--hypersphere-gains-mode row` / `col` / `rowcol` / `flat`", "`--md-gains row` / `col` / "
     "`rowcol` / `scalar`; unset: `none`"),
    ("`--hypersphere-gains-mode-output none`", "`--md-output-gains none` (unset: the matrices' "
     "mode, our default)"),
    ("`--hypersphere-gains-mode-embedding none`", "nothing (our embeddings have no gains)"),
    ("`--gain-parametrization direct` / `softplus`", "`--md-gain-map direct` / `softplus` "
     "(unset: `direct`, their default)"),
    ("`--gains-lr X`", "`--md-gain-lr X`"),
    ("`--gains-rank k` (gainz)", "`--md-gains lowrank --md-gain-rank k`"),
    ("`--gains-lowrank-init-std`, `--gains-lowrank-min` (gainz)", "`--md-lowrank-init-std`, "
     "`--md-lowrank-min`"),
    ("`--embedding-lr-multiplier m`", "`--embedding-lr` m·lr"),
    ("`--min-lr-mode absolute`", "nothing (our per-group floors are absolute)"),
    ("`--router-use-orthogonal-updates true` (and the `md-`, `master-` forms)", "nothing (the "
     "router is a Muon matrix under MuonMD)"),
    ("`--ademamix-alpha 0`", "nothing (AdEMAMix off)"),
    ("`--muon-scale-mode`, `--matrix-lr`, `--embedding-lr`, `--output-lr`, megatron's own",
     "the same"),
    ("anything else of theirs (`--master-use-normuon`, AdEMAMix on, other modes)",
     "refused, named"),
)  # fmt: skip
SPHERE = {"row": "row", "col": "col", "flat": "frobenius", "embed": "hidden"}
GAINS = {"row": "row", "col": "col", "rowcol": "rowcol", "flat": "scalar"}
#: their value-taking flags this module reads (every other ``--x v`` pair passes through)
VALUED = {
    "--optimizer", "--hypersphere-mode", "--hypersphere-embedding-mode",
    "--hypersphere-router-mode", "--hypersphere-gains-mode", "--hypersphere-gains-mode-output",
    "--hypersphere-gains-mode-embedding", "--gain-parametrization", "--gains-lr",
    "--gains-rank", "--gains-lowrank-init-std", "--gains-lowrank-min",
    "--embedding-lr-multiplier", "--min-lr-mode", "--router-use-orthogonal-updates",
    "--md-router-use-orthogonal-updates", "--master-router-use-orthogonal-updates",
    "--ademamix-alpha", "--lr",
}  # fmt: skip
SWITCHES = {
    "--use-orthogonal-updates", "--hypersphere-preserve-init",
    "--hypersphere-scale-out-proj-init", "--hypersphere-tangential-grad",
}  # fmt: skip
#: theirs with no equivalent here
REFUSED = {"--master-use-normuon", "--master-normuon-beta2", "--ademamix-beta3",
           "--ademamix-alpha-warmup", "--ademamix-beta3-warmup", "--muown-normuon-beta2",
           "--gains-no-clamp", "--gains-beta1", "--gains-beta2", "--gains-eps", "--gains-min",
           "--gains-weight-decay", "--hypersphere-soft", "--hypersphere-kind",
           "--hypersphere-no-update", "--hypersphere-radius"}  # fmt: skip


class Untranslatable(ValueError):
    """Flags of theirs with no equivalent here (the message names each)."""


def _split(argv: list[str]) -> tuple[dict, set, list[str]]:
    """(their valued flags, their switches, everything else as given)."""
    valued, switches, rest, i = {}, set(), [], 0
    while i < len(argv):
        a = argv[i]
        name, eq, val = a.partition("=")
        if name in VALUED:
            if not eq:
                if i + 1 >= len(argv):
                    raise Untranslatable(f"{name} needs a value")
                val, i = argv[i + 1], i + 1
            valued[name] = val
        elif name in SWITCHES:
            switches.add(name)
        elif name in REFUSED:
            raise Untranslatable(f"{name}: no equivalent here")
        else:
            rest.append(a)
        i += 1
    return valued, switches, rest


def translate(argv: list[str]) -> list[str]:
    """Their command line's flags -> ours (megatron's own flags pass through as given)."""
    v, sw, rest = _split(argv)
    bad: list[str] = []

    def pick(flag: str, table: dict, allowed_extra=()) -> str | None:
        val = v.get(flag)
        if val is None or val in allowed_extra:
            return val
        if val not in table:
            bad.append(f"{flag} {val}")
            return None
        return table[val]

    opt = v.get("--optimizer", "adam")
    md = opt in ("md_decoupling", "master")
    out: list[str] = []
    if not md:
        if opt not in ("adam", "muon", "muown"):
            bad.append(f"--optimizer {opt}")
        out.append(f"--optimizer={opt}")
        extra = [k for k in v if k.startswith(("--hypersphere", "--gain"))] + sorted(
            s for s in sw if s != "--use-orthogonal-updates"
        )
        if extra:
            bad.append(f"{', '.join(extra)} without --optimizer md_decoupling")
    else:
        base = "muon" if "--use-orthogonal-updates" in sw else "adam"
        out += [f"--optimizer={base}", "--md-decoupling"]
        sphere = pick("--hypersphere-mode", SPHERE)
        out.append(f"--md-sphere={sphere or 'none'}")
        # their projection at the start: sqrt(max(d_out, d_in)) for flat, 1 per row/column
        # (md_decoupling.py ``_normalize_single``)
        radius = "shape" if sphere in (None, "frobenius") else "unit"
        out.append("--md-radius=" + ("init" if "--hypersphere-preserve-init" in sw else radius))
        emb = pick("--hypersphere-embedding-mode", {"row": "row", "none": "none"})
        out += [f"--md-embedding-norm={emb or 'none'}", f"--md-output-norm={emb or 'none'}"]
        router = pick("--hypersphere-router-mode", {"row": "row", "none": "none"})
        out.append(f"--md-router-norm={router or 'none'}")
        gains = pick("--hypersphere-gains-mode", GAINS)
        if "--gains-rank" in v:
            gains = "lowrank"
            out.append(f"--md-gain-rank={v['--gains-rank']}")
        out.append(f"--md-gains={gains or 'none'}")
        head = v.get("--hypersphere-gains-mode-output")
        if head == "none":
            out.append("--md-output-gains=none")
        elif head is not None and GAINS.get(head) != gains:
            bad.append(f"--hypersphere-gains-mode-output {head} (only the matrices' mode or none)")
        if v.get("--hypersphere-gains-mode-embedding") not in (None, "none"):
            bad.append(
                f"--hypersphere-gains-mode-embedding {v['--hypersphere-gains-mode-embedding']}"
            )
        gmap = pick("--gain-parametrization", {"direct": "direct", "softplus": "softplus"})
        out.append(f"--md-gain-map={gmap or 'direct'}")
        if "--gains-lr" in v:
            out.append(f"--md-gain-lr={v['--gains-lr']}")
        for theirs, ours in (("--gains-lowrank-init-std", "--md-lowrank-init-std"),
                             ("--gains-lowrank-min", "--md-lowrank-min")):  # fmt: skip
            if theirs in v:
                out.append(f"{ours}={v[theirs]}")
        if "--hypersphere-tangential-grad" in sw:
            out.append("--md-tangent-grad")
    if "--hypersphere-scale-out-proj-init" in sw:
        out.append("--scaled-output-init")
    if "--embedding-lr-multiplier" in v:
        if "--lr" not in v:
            bad.append("--embedding-lr-multiplier without --lr")
        else:
            lr = float(v["--lr"]) * float(v["--embedding-lr-multiplier"])
            out.append(f"--embedding-lr={lr:.6g}")
    if v.get("--min-lr-mode", "absolute") != "absolute":
        bad.append(f"--min-lr-mode {v['--min-lr-mode']} (our per-group floors are absolute)")
    for flag in ("--router-use-orthogonal-updates", "--md-router-use-orthogonal-updates",
                 "--master-router-use-orthogonal-updates"):  # fmt: skip
        if v.get(flag, "true").lower() != "true":
            bad.append(f"{flag} {v[flag]} (the router is a Muon matrix under MuonMD)")
    if float(v.get("--ademamix-alpha", 0)) != 0:
        bad.append(f"--ademamix-alpha {v['--ademamix-alpha']} (AdEMAMix is not offered)")
    if "--lr" in v:
        out.append(f"--lr={v['--lr']}")
    if bad:
        raise Untranslatable("no equivalent here for: " + "; ".join(bad))
    return out + rest

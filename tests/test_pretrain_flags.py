"""pretrain_gpt.py's command line: every --md-* flag parses and reaches the MD config, the
paper's defaults apply with --md-decoupling, and bad input stops with a message naming it."""

import argparse
import json
import math
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
from megatron.md.train import cli as pg  # noqa: E402  (what pretrain_gpt.py runs)

BASE = [
    "--preset=tiny",
    "--mock-data",
    "--tokenizer-type=NullTokenizer",
    "--vocab-size=1024",
    "--seq-length=64",
    "--max-position-embeddings=64",
    "--micro-batch-size=2",
    "--global-batch-size=2",
    "--train-iters=4",
    "--lr=1e-3",
]


@pytest.fixture(autouse=True)
def _env(monkeypatch):
    for k, v in dict(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0").items():
        monkeypatch.setenv(k, v)
    monkeypatch.setattr(sys, "argv", ["pretrain_gpt.py"])
    import megatron.training.global_vars as gv

    gv.unset_global_variables()  # parse_and_validate_args sets them once per process
    yield
    gv.unset_global_variables()


def parse(*extra, base=BASE):
    import megatron.training.global_vars as gv

    gv.unset_global_variables()
    return pg.parse(list(base) + list(extra), on_cpu=True)


def fails(capsys, *extra, base=BASE) -> str:
    with pytest.raises(SystemExit) as e:
        parse(*extra, base=base)
    out = capsys.readouterr()
    return str(e.value.code) + out.err + out.out


FLAGS = [
    ("--md-sphere", "row", "sphere", "row"),
    ("--md-radius", "shape", "radius", "shape"),
    ("--md-gains", "lowrank", "gains", "lowrank"),
    ("--md-gain-rank", "3", "gain_rank", 3),
    ("--md-gain-map", "exp", "gain_map", "exp"),
    ("--md-gain-lr", "1e-3", "gain_lr", 1e-3),
    ("--md-embedding-norm", "none", "embedding_norm", "none"),
    ("--md-output-norm", "none", "output_norm", "none"),
    ("--md-router-norm", "none", "router_norm", "none"),
    ("--muon-scale-mode", "shape_up", "muon_scale", "shape_up"),
    ("--muon-scale-mode", "rms_match", "muon_scale", "rms_match"),
]


@pytest.mark.parametrize("flag,value,field,expected", FLAGS)
def test_md_flag_reaches_config(flag, value, field, expected):
    needs = ["--md-gains=lowrank"] if flag == "--md-gain-rank" else []  # (refused without)
    _, md = parse("--md-decoupling", *needs, f"{flag}={value}")
    assert getattr(md, field) == expected


def test_md_defaults_are_the_paper_recipe():
    args, md = parse("--md-decoupling", "--optimizer=muon")
    assert (md.sphere, md.radius, md.gains, md.gain_map) == (
        "frobenius",
        "init",
        "rowcol",
        "softplus",
    )
    assert md.muon_scale == "sphere_rms" and md.gain_lr is None and not md.tangent_grad
    assert (md.embedding_norm, md.output_norm, md.router_norm) == ("row", "row", "row")
    assert args.weight_decay == 0 and args.muon_momentum == 0.95 and args.muon_nesterov
    assert args.muon_split_qkv and md.split_qkv and args.adam_beta2 == 0.99  # upstream split
    assert md.residual_init_scale == 1.0
    assert args.init_method_std == pytest.approx(1 / math.sqrt(128))
    _, md = parse("--md-decoupling", "--md-tangent-grad")
    assert md.tangent_grad
    args, md = parse()
    assert md is None and args.weight_decay == 0.01  # megatron's own default without MD


def test_preset_and_cpu_flags_are_overridable():
    args, _ = parse("--hidden-size=256", "--num-layers=2")
    assert (args.hidden_size, args.num_layers, args.num_attention_heads) == (256, 2, 2)
    assert args.init_method_std == pytest.approx(1 / 16)
    assert args.transformer_impl == "local" and args.distributed_backend == "gloo"
    assert args.qk_layernorm and args.untie_embeddings_and_output_weights and args.swiglu
    args, _ = parse("--preset=moe-0.27B-1.2B")
    assert args.num_experts == 64 and args.moe_router_topk == 2 and not args.sandwich_norm
    assert args.moe_layer_freq == [0] + [1] * 13 and args.kv_channels == 64


def test_a_gpu_without_te_or_apex_kernels_turns_their_fusions_off(monkeypatch, capsys):
    """On a bare PyTorch image (no TE, no apex: the lent H100, 2026-11-25) megatron refused
    rope fusion at start-up; the fusions whose kernels do not import are turned off, loudly.
    Here none of those kernels import, as there."""
    import importlib

    from megatron.md.train import patches

    assert patches.kernel_flags() == [
        "--no-rope-fusion", "--no-gradient-accumulation-fusion", "--no-masked-softmax-fusion",
        "--no-persist-layer-norm",
    ]  # fmt: skip
    argv = pg.expand_argv(["--preset=tiny", "--hidden-size=64"], on_cpu=False)
    assert "--no-rope-fusion" in argv and "--distributed-backend=gloo" not in argv
    assert argv.index("--no-rope-fusion") < argv.index("--hidden-size=64")  # the user's win
    assert "no Transformer Engine / apex kernels here" in capsys.readouterr().out
    real = importlib.import_module
    monkeypatch.setattr(importlib, "import_module", lambda m: m if "cuda" in m else real(m))
    assert patches.kernel_flags() == ["--no-rope-fusion", "--no-persist-layer-norm"]


@pytest.mark.parametrize(
    "flag", ["--md-sphere", "--md-radius", "--md-gains", "--md-gain-map", "--md-router-norm"]
)
def test_bad_choice_names_the_flag(capsys, flag):
    assert flag in fails(capsys, "--md-decoupling", f"{flag}=bogus")


@pytest.mark.parametrize(
    "extra,needle",
    [
        (["--md-decoupling", "--weight-decay=0.1"], "--weight-decay must be 0"),
        (["--md-decoupling", "--fp16"], "--fp16"),
        (["--md-decoupling", "--md-gains=lowrank", "--md-gain-rank=0"], "--md-gain-rank"),
        (["--md-decoupling", "--md-gain-lr=-1"], "--md-gain-lr"),
        (["--muon-scale-mode=sphere_rms"], "needs --md-decoupling"),
        (["--md-decoupling", "--muon-scale-mode=bogus"], "--muon-scale-mode"),
        (
            [
                "--optimizer=muon",
                "--use-distributed-optimizer",
                "--save=/tmp/x",
                "--save-interval=2",
            ],
            "--bf16",
        ),
        (["--lr-decay-style=cosine", "--wsd-cooldown-fraction=0.2"], "WSD"),
        (["--preset=nope"], "--preset"),
        # megatron loads a newer non-persistent checkpoint even under --ckpt-step (measured
        # by hand, 2026-11-28: --ckpt-step 4 loaded the non-persistent 6)
        (
            ["--non-persistent-save-interval=2", "--non-persistent-ckpt-type=global"],
            "--non-persistent-save-interval: megatron loads a non-persistent checkpoint instead",
        ),
        (["--non-persistent-ckpt-type=global"], "--non-persistent-ckpt-type: megatron loads"),
        (  # refused by the optimizer's build, after the model, with a traceback (2026-11-28)
            ["--md-decoupling", "--optimizer=muon", "--bf16", "--muon-extra-scale-factor=0.2"],
            "--muon-extra-scale-factor=0.2: MuonMD sets the update's scale with",
        ),
        # megatron-core 0.19.2's upcycling fails either way (measured by hand, 2026-11-28)
        (
            ["--num-experts=4", "--moe-use-upcycling", "--save=/tmp/y", "--save-interval=2"],
            "--moe-use-upcycling: megatron-core 0.19.2's upcycling does not run",
        ),
        (
            ["--md-decoupling", "--pretrained-checkpoint=/nonexistent/pre"],
            "--pretrained-checkpoint /nonexistent/pre holds no checkpoint",
        ),
        # parsed, never read by megatron-core 0.19.2: the batch was --global-batch-size from
        # iteration 1 (seen, 2026-11-29; --step-batch-size-schedule ramps it)
        (["--rampup-batch-size", "2", "2", "40"], "--rampup-batch-size is parsed and not used"),
        (["--openai-gelu"], "--openai-gelu is parsed and read nowhere"),  # (likewise)
        (["--init-model-with-meta-device"], "then makes the model's memory with torch's to_"),
        # every resume stopped (each seen by hand, 2026-11-29)
        (["--dist-ckpt-strictness=raise_all"], "reports its own checkpoints' rerun_state_"),
        (["--dist-ckpt-strictness=return_all"], "megatron's training load does not take"),
        (["--dist-ckpt-strictness=return_unexpected"], "megatron's training load does not take"),
        # Megatron-LM's own entry point wraps pretrain for it; this one does not (2026-11-29)
        (
            ["--inprocess-restart"],
            "--inprocess-restart: pretrain_gpt.py does not wrap its training",
        ),
    ],
)
def test_bad_input_stops_with_a_message(capsys, extra, needle):
    assert needle in fails(capsys, *extra)


def test_missing_data_and_tokenizer_are_named(capsys, tmp_path):
    base = [a for a in BASE if a != "--mock-data"]
    msg = fails(capsys, f"--data-path={tmp_path}/corpus_text_document", base=base)
    assert "corpus_text_document.bin does not exist" in msg
    msg = fails(capsys, base=base)
    assert "--data-path" in msg
    hf = [a for a in BASE if "Tokenizer" not in a and "vocab" not in a]
    msg = fails(
        capsys, "--tokenizer-type=HuggingFaceTokenizer", f"--tokenizer-model={tmp_path}", base=hf
    )
    assert "tokenizer.json" in msg


def test_eval_interval_defaults_to_1000():
    """megatron-core 0.19.2 leaves it None and then divides by it (a TypeError mid-start-up)."""
    args, _ = parse()
    assert args.eval_interval == 1000
    args, _ = parse("--eval-interval=7")
    assert args.eval_interval == 7


def test_md_adam_layer_wise_selects_megatron_layer_wise_sharding():
    args, md = parse(
        "--md-decoupling", "--md-adam-layer-wise", "--optimizer=adam", "--use-distributed-optimizer"
    )
    assert md.adam_layer_wise and args.optimizer == "adam"
    assert args.use_layer_wise_distributed_optimizer and not args.use_distributed_optimizer


def test_wsd_cooldown_fraction_sets_decay_iters():
    args, _ = parse(
        "--train-iters=100", "--lr-decay-style=WSD", "--lr-wsd-decay-style=minus_sqrt",
        "--wsd-cooldown-fraction=0.2",
    )  # fmt: skip
    assert args.lr_wsd_decay_iters == 20


@pytest.mark.parametrize(
    "extra,needle",
    [
        (["--train-iters=4", "--lr-decay-style=WSD"], "--lr-decay-style WSD needs its cooldown: "
         "--lr-wsd-decay-iters N or --wsd-cooldown-fraction F"),
        (["--train-samples=40", "--lr-warmup-samples=40"], "--lr-warmup-samples=40 is not "
         "shorter than the decay (--train-samples=40)"),
        (["--train-iters=10", "--lr-decay-iters=4", "--lr-warmup-iters=5"], "--lr-warmup-iters=5 "
         "is not shorter than the decay (--lr-decay-iters=4)"),
        (["--train-iters=10", "--lr-warmup-fraction=1.0"], "--lr-warmup-fraction=1.0 is not "
         "shorter than the decay (--train-iters=10)"),
        (["--train-iters=10", "--lr-warmup-init=1e-2"], "--lr-warmup-init=0.01 is above "
         "--lr=0.001"),
        (["--train-iters=10", "--lr-decay-iters=0"], "--lr-decay-iters=0: the learning rate "
         "would decay over no step"),
    ],
)  # fmt: skip
def test_a_schedule_megatron_would_assert_on_later_is_named(capsys, extra, needle):
    """megatron-core 0.19.2 asserts these in its LR scheduler, built after the model and the
    optimizer, with no flag named (each seen by hand, 2026-11-29): refused at start-up."""
    base = [a for a in BASE if not a.startswith("--train-iters")]
    assert needle in fails(capsys, *extra, base=base)


def test_full_validation_of_one_set_needs_the_line_it_works_around(capsys, monkeypatch):
    """The one-set --full-validation workaround (metrics.wrap_evaluate_and_print) fits
    megatron-core 0.19.2's evaluation; a release without that line is refused at start-up."""
    from megatron.md.train import metrics

    assert metrics.one_set_full_validation_fits()
    args, _ = parse("--full-validation")
    assert args.full_validation
    monkeypatch.setattr(metrics, "FULL_VALIDATION_LINE", "eval_iters = not megatron's line")
    assert "--full-validation with one validation set: megatron-core's evaluation no longer" \
        in fails(capsys, "--full-validation")  # fmt: skip


def test_wsd_cooldown_fraction_of_a_run_counted_in_samples():
    """--wsd-cooldown-fraction with --train-samples: megatron's WSD cooldown in samples (it
    multiplied the fraction by the unset --train-iters: a TypeError at start-up, seen)."""
    base = [a for a in BASE if not a.startswith("--train-iters")]
    args, _ = parse("--train-samples=40", "--lr-decay-style=WSD", "--wsd-cooldown-fraction=0.2",
                    base=base)  # fmt: skip
    assert args.lr_wsd_decay_samples == 8 and args.lr_wsd_decay_iters is None


def test_load_names_a_missing_or_partial_checkpoint(tmp_path):
    """The loader names what it found: nothing to resume, a missing or half-written iteration,
    a tracker naming no iteration, and a checkpoint in megatron's other format."""
    from megatron.md.train.ckpt_checks import locate

    assert locate(str(tmp_path)) is None  # nothing to resume: a fresh run
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("8\n")
    with pytest.raises(SystemExit, match="iter_0000008 is missing or not a complete"):
        locate(str(tmp_path))
    (tmp_path / "iter_0000008").mkdir()  # a save killed before its metadata was written
    with pytest.raises(SystemExit, match="nothing was read or changed"):
        locate(str(tmp_path))
    (tmp_path / "iter_0000008" / ".metadata").write_bytes(b"")
    found = locate(str(tmp_path))
    assert (found.path, found.format) == (str(tmp_path / "iter_0000008"), "torch_dist")
    with pytest.raises(SystemExit, match="iter_0000004"):
        locate(str(tmp_path), step=4)
    (tmp_path / "iter_0000004" / "mp_rank_00").mkdir(parents=True)  # --ckpt-format torch
    assert locate(str(tmp_path), step=4).format == "torch"
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("eight\n")
    with pytest.raises(SystemExit, match="not an iteration"):
        locate(str(tmp_path))


def test_a_tracker_naming_no_complete_checkpoint_lists_the_complete_ones(tmp_path):
    """A tracker cut while megatron wrote it, or naming a save that was cut: the refusal lists
    the complete checkpoints the directory holds (``--ckpt-step``), not the cut one."""
    from megatron.md.train.ckpt_checks import locate

    for i in (2, 4, 6):
        (tmp_path / f"iter_{i:07d}").mkdir()
    for i in (2, 4):
        (tmp_path / f"iter_{i:07d}" / ".metadata").write_bytes(b"")
    tracker = tmp_path / "latest_checkpointed_iteration.txt"
    tracker.write_text("")
    with pytest.raises(SystemExit) as e:
        locate(str(tmp_path))
    assert str(e.value).endswith(f"holds '', not an iteration (a save cut while writing it?): "
                                 f"resume a complete one with --ckpt-step N ({tmp_path} holds "
                                 "2, 4)")  # fmt: skip
    tracker.write_text("6")
    with pytest.raises(SystemExit) as e:
        locate(str(tmp_path))
    assert f"resume a complete one with --ckpt-step N ({tmp_path} holds 2, 4); nothing" in str(
        e.value
    )
    with pytest.raises(SystemExit) as e:
        locate(str(tmp_path), step=8)
    assert f"({tmp_path} holds 2, 4)" in str(e.value)
    for i in (2, 4):
        (tmp_path / f"iter_{i:07d}" / ".metadata").unlink()
    with pytest.raises(SystemExit) as e:
        locate(str(tmp_path))
    assert f"{tmp_path} holds no other complete checkpoint; nothing was read" in str(e.value)


def test_help_prints(capsys):
    """``--help`` lists megatron's flags and ours (upstream's help strings hold a bare ``%``,
    which argparse's formatting would choke on)."""
    with pytest.raises(SystemExit) as e:
        parse("--help")
    out = capsys.readouterr().out
    assert e.value.code == 0
    assert "--md-decoupling" in out and "--moe-paged-stash-buffer-size-factor-cuda" in out
    assert "10%)" in out


@pytest.mark.parametrize(
    "extra,needle",
    [
        (["--md-decoupling", "--ckpt-format=torch", "--save=/tmp/x", "--save-interval=2"],
         "--ckpt-format torch: MD runs save and load their state in torch_dist only"),
        (["--md-decoupling", "--md-gain-rank=3"], "--md-gain-rank 3 needs --md-gains lowrank"),
    ],
)  # fmt: skip
def test_md_refusals_name_the_flag(capsys, extra, needle):
    assert needle in fails(capsys, *extra)
    args, md = parse("--md-decoupling", "--md-gains=lowrank", "--md-gain-rank=3")
    assert md.gain_rank == 3


def test_missing_lr_is_named(capsys):
    base = [f for f in BASE if not f.startswith("--lr=")]
    for extra in ([], ["--md-decoupling"]):
        assert "give --lr (the peak learning rate" in fails(capsys, *extra, base=base)


def test_a_refusal_is_one_line_from_rank_0(capsys, monkeypatch, tmp_path):
    """errors.one_line: rank 0 says the sentence once (and leaves it for the launcher in
    MEGATRON_MD_ERROR_FILE); other ranks leave silently; the exit status is 2, no traceback."""
    from megatron.md import errors

    for rank in ("0", "1"):
        monkeypatch.setenv("RANK", rank)
        monkeypatch.setenv("MEGATRON_MD_ERROR_FILE", str(tmp_path / f"err{rank}"))
        with pytest.raises(SystemExit) as e:
            with errors.one_line():
                errors.fail("--thing is wrong")
        out = capsys.readouterr()
        assert e.value.code == 2 and not out.out
        said = "pretrain_gpt.py: error: --thing is wrong\n"
        assert out.err == (said if rank == "0" else "")
        assert (tmp_path / f"err{rank}").exists() == (rank == "0")


def test_a_silent_rank_leaves_after_rank_0_has_said_the_refusal(monkeypatch, tmp_path):
    """A rank that leaves a refusal to rank 0 waits for rank 0's line in
    MEGATRON_MD_ERROR_FILE before leaving (leaving first, it made torchrun stop rank 0 before
    rank 0 said anything: CI, 2026-12-04); without the file a fixed wait; one process alone,
    none."""
    import threading
    import time

    from megatron.md import errors

    err = tmp_path / "startup_error"
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("MEGATRON_MD_ERROR_FILE", str(err))
    threading.Timer(0.5, lambda: err.write_text("pretrain_gpt.py: error: x\n")).start()
    t0 = time.monotonic()
    with pytest.raises(SystemExit) as e, errors.one_line():
        errors.fail("--thing is wrong")
    assert e.value.code == 2 and 0.5 <= time.monotonic() - t0 < 5
    monkeypatch.delenv("MEGATRON_MD_ERROR_FILE")
    monkeypatch.setattr(errors, "WAIT_BLIND_S", 0.3)
    t0 = time.monotonic()
    with pytest.raises(SystemExit), errors.one_line():
        errors.fail("--thing is wrong")
    assert 0.3 <= time.monotonic() - t0 < 5
    monkeypatch.setenv("WORLD_SIZE", "1")
    t0 = time.monotonic()
    with pytest.raises(SystemExit), errors.one_line():
        errors.fail("--thing is wrong")
    assert time.monotonic() - t0 < 0.2


def test_a_refusal_about_a_node_s_files_is_said_by_each_node_s_first_rank(
    capsys, monkeypatch, tmp_path
):
    """A refusal about the files a node sees (its copy of the data, the tokenizer): rank 0
    says it, and so does each other node's first rank, naming itself (the others leave
    silently); in MEGATRON_MD_ERROR_FILE rank 0's line replaces another's, another's never
    replaces one."""
    import socket

    from megatron.md import errors

    err = tmp_path / "startup_error"
    monkeypatch.setenv("MEGATRON_MD_ERROR_FILE", str(err))
    said = "pretrain_gpt.py: error: --data-path: x.bin does not exist"
    on = lambda r: f"{said} (on {socket.gethostname()}, rank {r})\n"  # noqa: E731
    # rank, local rank: what it prints, and the error file afterwards
    for rank, local, printed, kept in (("1", "1", "", None), ("8", "0", on(8), on(8)),
                                       ("16", "0", on(16), on(8)),
                                       ("0", "0", said + "\n", said + "\n")):  # fmt: skip
        monkeypatch.setenv("RANK", rank)
        monkeypatch.setenv("LOCAL_RANK", local)
        with pytest.raises(SystemExit) as e:
            with errors.one_line():
                errors.fail("--data-path: x.bin does not exist", node=True)
        out = capsys.readouterr()
        assert e.value.code == 2 and not out.out
        assert out.err == printed, rank
        assert (err.read_text() if err.exists() else None) == kept, rank


@pytest.mark.parametrize(
    "env,argv,why",
    [
        ({"MEGATRON_MD_LAUNCHER": "slurm"}, [], "started by launch.sbatch"),
        ({"SLURM_GPUS_ON_NODE": "4"}, [], "SLURM allocated GPUs to it (SLURM_GPUS_ON_NODE=4)"),
        ({"SLURM_JOB_GPUS": "0,1"}, [], "SLURM_JOB_GPUS=0,1"),
        ({}, ["--distributed-backend", "nccl"], "asks for --distributed-backend nccl"),
        ({"SLURM_GPUS_ON_NODE": "0"}, ["--distributed-backend=gloo"], None),
        ({}, [], None),
    ],
)
def test_a_gpu_job_without_a_gpu_is_named(env, argv, why):
    """What makes a run a GPU job (cpu_mode.gpu_job), which then stops instead of training on
    the CPU unless MEGATRON_MD_CPU_MODE=1 asks for the CPU."""
    from megatron.md import cpu_mode

    got = cpu_mode.gpu_job(argv, env)
    assert (got is None) if why is None else (why in got), got


def test_a_gpu_job_stops_and_cpu_mode_on_purpose_runs(capsys, monkeypatch):
    from megatron.md import cpu_mode

    monkeypatch.setenv("MEGATRON_MD_LAUNCHER", "slurm")
    monkeypatch.delenv("MEGATRON_MD_CPU_MODE", raising=False)
    with pytest.raises(SystemExit) as e:
        cpu_mode.start([])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "no CUDA device is visible, but this is a GPU job" in err
    assert "MEGATRON_MD_CPU_MODE=1" in err
    monkeypatch.setenv("MEGATRON_MD_CPU_MODE", "1")
    assert cpu_mode.start([]) is True  # (already active in this process: idempotent)
    monkeypatch.setenv("MEGATRON_MD_CPU_MODE", "yes")
    with pytest.raises(SystemExit):
        cpu_mode.start([])


@pytest.mark.parametrize(
    "extra,needle",
    [
        (
            ["--lr-warmup-iters=4"],
            "--lr-warmup-iters=4 is not shorter than the decay (--train-iters=4)",
        ),
        (["--md-from-plain-checkpoint"], "needs --md-decoupling and --load"),
        (["--optimizer=muon", "--use-torch-fsdp2"], "FSDP"),
        (["--md-adam-layer-wise"], "--md-adam-layer-wise needs --md-decoupling"),
        (["--md-cuda-graph"], "--md-cuda-graph needs --md-decoupling"),
        # read nowhere without the switch: the run trained plain Adam, unnamed
        (
            ["--md-sphere=row", "--md-gain-lr=1e-3"],
            "--md-gain-lr, --md-sphere: MD's step runs only with --md-decoupling, so this run "
            "would train plain --optimizer adam: add --md-decoupling, or drop them",
        ),
        (["--ngpt-alpha-init=0.1"], "--ngpt-alpha-init: nGPT's residual steps exist only with"),
        (["--md-decoupling", "--md-cuda-graph"], "--md-cuda-graph needs CUDA"),
        (["--md-decoupling", "--attention-output-gate"], "add --muon-no-split-qkv (the fused"),
        # on a CPU megatron failed at the profile's start / the first log (seen, 2026-11-29)
        (["--profile"], "--profile needs CUDA without --use-pytorch-profiler"),
        (["--log-memory-to-tensorboard"], "--log-memory-to-tensorboard reads CUDA's memory"),
        (["--md-decoupling", "--optimizer-cuda-graph"], "use --md-cuda-graph"),
        (
            ["--md-decoupling", "--md-cuda-graph", "--bf16", "--grad-reduce-in-bf16"],
            "drop --grad-reduce-in-bf16",
        ),  # fmt: skip
        (
            ["--md-decoupling", "--md-adam-layer-wise", "--optimizer=muon"],
            "needs --optimizer adam (got muon) and --use-distributed-optimizer",
        ),
        (
            ["--md-decoupling", "--md-adam-layer-wise"],
            "layer-wise needs --use-distributed-optimizer",
        ),
        # read again at every resume from --load: a requeue lost its optimizer state (2026-11-29)
        (
            ["--init-from=/x", "--load=/y", "--no-load-optim"],
            "--init-from with --no-load-optim: megatron reads it at every resume of this run",
        ),
        (["--init-from=/x", "--load=/y", "--finetune"], "and restart at iteration 0); drop it"),
        (
            [
                "--md-decoupling",
                "--num-experts=4",
                "--moe-grouped-gemm",
                "--moe-single-grouped-weight",
            ],
            "--moe-single-grouped-weight keeps every local expert in one parameter",
        ),  # fmt: skip
    ],
)
def test_contradictory_flags_stop(capsys, extra, needle):
    assert needle in fails(capsys, *extra)


def test_megatrons_dataset_flags_reach_the_dataset_config(tmp_path):
    """Every megatron flag that sets a GPTDatasetConfig field reaches it (data.DATASET_FLAGS);
    the provider passed eleven, and the others (--multiple-validation-sets, --no-mmap-bin-files,
    --object-storage-cache-path, --per-dataset-sequences-path, ...) were ignored without a
    word. A field megatron's parser has a flag for (its own name, or ``dataloader_`` and its
    name) and that is not mapped fails here."""
    import dataclasses
    import json

    from megatron.core.datasets.gpt_dataset import GPTDatasetConfig

    from megatron.md.train.data import DATASET_FLAGS, dataset_config

    counts = tmp_path / "sequences.json"
    counts.write_text(json.dumps({"/data/a": 400}))
    import megatron.training.global_vars as gv

    gv.unset_global_variables()
    sets = ["--train-data-path=/data/t", "--valid-data-path", "/data/a", "/data/b"]
    args = pg.parse([a for a in BASE if a != "--mock-data"] + sets + [
                 "--multiple-validation-sets", "--full-validation", "--no-mmap-bin-files",
                 "--num-dataset-builder-threads=3", "--mid-level-dataset-surplus=0.01",
                 "--allow-ambiguous-pad-tokens", "--dataloader-fast-cache-load",
                 "--dataloader-defer-npy-index-mmap", "--object-storage-cache-path=/tmp/o",
                 f"--per-dataset-sequences-path={counts}", "--seed=7",
                 "--data-cache-path=/tmp/c"], on_cpu=True, check_data=False)[0]  # fmt: skip
    got = dataset_config(args)
    assert {k: got[k] for k in ("multiple_validation_sets", "full_validation", "mmap_bin_files",
                                "num_dataset_builder_threads", "mid_level_dataset_surplus",
                                "allow_ambiguous_pad_tokens", "fast_cache_load",
                                "defer_npy_index_mmap", "object_storage_cache_path",
                                "sequences_per_dataset", "random_seed", "path_to_cache")} == {
        "multiple_validation_sets": True, "full_validation": True, "mmap_bin_files": False,
        "num_dataset_builder_threads": 3, "mid_level_dataset_surplus": 0.01,
        "allow_ambiguous_pad_tokens": True, "fast_cache_load": True,
        "defer_npy_index_mmap": True, "object_storage_cache_path": "/tmp/o",
        "sequences_per_dataset": {"/data/a": 400}, "random_seed": 7, "path_to_cache": "/tmp/c",
    }  # fmt: skip
    fields = {f.name for f in dataclasses.fields(GPTDatasetConfig)}
    flagged = {f for f in fields for d in (f, "dataloader_" + f) if hasattr(args, d)}
    assert flagged - set(DATASET_FLAGS.values()) == {
        "context_parallel_size",  # megatron-core 0.19.2's datasets do not read these two
        "data_parallel_size",
        "inter_document_masking",  # refused (test_megatrons_own_late_data_refusals_come_first)
        "hybrid_context_parallel",
    }, flagged - set(DATASET_FLAGS.values())


@pytest.mark.parametrize(
    "extra,needle",
    [
        (["--multiple-validation-sets"], "--multiple-validation-sets needs --full-validation"),
        (
            ["--phase-transition-iterations=2"],
            "--phase-transition-iterations needs --train-samples",
        ),
        (["--per-dataset-sequences-path=/nowhere.json"], "/nowhere.json cannot be read as JSON"),
        (["--dataloader-inter-document-masking"], "pretrain_gpt.py's reads none"),
        (["--sft"], "--sft: pretrain_gpt.py builds megatron-core's GPTDataset"),
        (["--fim-data", "--data-path", "/d/a"], "not megatron's GPTFIMDataset"),
        (
            ["--hybrid-context-parallel", "--calculate-per-token-loss"],
            "--hybrid-context-parallel needs a forward step",
        ),
        (
            ["--full-validation", "--data-path", "1", "/d/a", "1", "/d/b"],
            "--full-validation takes --data-path without weights",
        ),
        (
            ["--multiple-validation-sets", "--full-validation", "--split=90,5,5"],
            "--multiple-validation-sets with a test set",
        ),
        (
            ["--multiple-validation-sets", "--full-validation", "--split=100,0,0"],
            "without --valid-data-path megatron-core 0.19.2 builds one validation set",
        ),
        (
            ["--validation-set-names", "wiki", "--split=100,0,0"],
            "--validation-set-names needs --multiple-validation-sets",
        ),
        (
            [
                "--multiple-validation-sets",
                "--full-validation",
                "--validation-set-names",
                "a",
                "--train-data-path",
                "/d/t",
                "--valid-data-path",
                "/d/a",
                "/d/b",
            ],
            "--validation-set-names names 1 set(s) for 2 validation datasets",
        ),
    ],
)
def test_megatrons_own_late_data_refusals_come_first(capsys, extra, needle):
    """megatron-core stops these only once the model is built (NotImplementedError; an
    assert as it builds the validation sets); the packed-sequence flags would have trained
    with attention across documents (the forward step reads no cu_seqlens)."""
    paths = {"--data-path", "--valid-data-path"}
    base = [a for a in BASE if a != "--mock-data"] if paths & set(extra) else BASE
    assert needle in fails(capsys, *extra, base=base)


def test_validation_set_names_are_counted_in_a_per_split_data_args_file(capsys, tmp_path):
    """``--per-split-data-args-path``'s ``valid`` list is what megatron builds the validation
    sets from (get_blend_and_blend_per_split), and its ``test`` a test set (refused with
    ``--multiple-validation-sets``, as ``--test-data-path`` is)."""
    splits = tmp_path / "splits.json"
    splits.write_text(json.dumps({"train": "/d/t", "valid": ["/d/a", "/d/b"], "test": None}))
    base = [a for a in BASE if a != "--mock-data"]
    msg = fails(capsys, f"--per-split-data-args-path={splits}",
                "--multiple-validation-sets", "--full-validation", "--split=100,0,0",
                "--validation-set-names", "a", "b", "c", base=base)  # fmt: skip
    assert "--validation-set-names names 3 set(s) for 2 validation datasets" in msg
    splits.write_text(json.dumps({"train": "/d/t", "valid": ["/d/a", "/d/b"], "test": "/d/c"}))
    msg = fails(capsys, f"--per-split-data-args-path={splits}", "--multiple-validation-sets",
                "--full-validation", "--split=100,0,0", base=base)  # fmt: skip
    assert "--multiple-validation-sets with a test set" in msg  # the file's test set counts


def test_datasets_in_object_storage_are_not_refused_as_missing_files(capsys, tmp_path):
    """An ``s3://`` or ``msc://`` prefix (megatron-core reads it there) was refused as a file
    that does not exist; now it needs the two local directories megatron keeps its indices
    in, and with them passes the start-up checks (no object is read before the datasets are
    built; no object store here to build them from)."""
    base = [a for a in BASE if a != "--mock-data"]
    remote = "s3://bucket/corpus_text_document"
    msg = fails(capsys, f"--data-path={remote}", base=base)
    assert "--data-path names datasets in object storage: give --object-storage-cache-path" in msg
    msg = fails(capsys, f"--data-path={remote}", f"--object-storage-cache-path={tmp_path}",
                base=base)  # fmt: skip
    assert "give --data-cache-path a local directory" in msg
    args, _ = parse(f"--data-path={remote}", f"--object-storage-cache-path={tmp_path}",
                    f"--data-cache-path={tmp_path}", base=base)  # fmt: skip
    assert args.data_path == [remote]


@pytest.mark.parametrize(
    "extra,needle",
    [
        (
            ["--optimizer=muon", "--muon-tp-mode=blockwise", "--num-query-groups=2"],
            "--muon-tp-mode duplicated",
        ),
        (["--optimizer=muown"], "(Muown) with (expert) TP > 1 is not supported"),
        (["--optimizer=muon", "--num-query-groups=1"], "do not divide over TP = 2"),
    ],
)
def test_md_under_tensor_parallelism_refuses_what_it_lacks(capsys, monkeypatch, extra, needle):
    """MD under TP (megatron/md/tensor_parallel.py): AdamMD and MuonMD run (MuonMD with the
    full matrix orthogonalized, the MD recipe's --muon-tp-mode), fp32 or bf16 checkpoints;
    not Muown."""
    monkeypatch.setenv("WORLD_SIZE", "2")
    tp = ["--md-decoupling", "--tensor-model-parallel-size=2"]
    assert needle in fails(capsys, *tp, *extra)
    for dtype in ([], ["--bf16"]):  # AdamMD splits Q/K/V too: whole query groups per rank
        args, md = parse(*tp, *dtype, "--num-query-groups=2", "--save=/tmp/x", "--save-interval=2")
        assert md is not None and args.tensor_model_parallel_size == 2 and md.split_qkv
    assert "do not divide over TP = 2" in fails(capsys, *tp, "--num-query-groups=1")
    args, md = parse(*tp, "--optimizer=muon", "--bf16", "--num-query-groups=2")
    assert md is not None and args.muon_tp_mode == "duplicated" and md.split_qkv


def test_moe_and_sequence_parallelism_under_tp_are_refused_where_megatron_fails_late(
    capsys, monkeypatch
):
    """Under TP megatron's MoE layer trains only with --sequence-parallel (a ValueError at the
    first forward step) and torch's norms, the local layer spec's, refuse sequence parallelism
    (an assertion at the model's build): both seen after the build at TP 2 on 2 CPU ranks, now
    refused at start-up; MoE with expert TP at TP 1, evaluation only, TP 1 (megatron drops
    --sequence-parallel there) and Transformer Engine's layers are not."""
    monkeypatch.setenv("WORLD_SIZE", "2")
    tp, moe = ["--tensor-model-parallel-size=2", "--num-query-groups=2"], ["--num-experts=4"]
    msg = fails(capsys, *tp, *moe)
    assert "--num-experts with TP 2 needs --sequence-parallel" in msg
    assert "experts train at TP 1 (split them with --expert-tensor-parallel-size" in msg
    msg = fails(capsys, *tp, "--sequence-parallel")
    assert "--sequence-parallel: torch's norms of the local layer spec" in msg
    assert "torch_norm.py:50" in fails(capsys, *tp, *moe, "--sequence-parallel")
    parse(*moe, "--expert-tensor-parallel-size=2", "--global-batch-size=4")  # (DP 2)
    parse(*tp, *moe, "--skip-train")
    args, _ = parse("--sequence-parallel", "--global-batch-size=4")
    assert not args.sequence_parallel
    from megatron.md.train import args as md_args

    te = argparse.Namespace(tensor_model_parallel_size=2, num_experts=4, sequence_parallel=True,
                            skip_train=False, transformer_impl="transformer_engine",
                            normalization="RMSNorm")  # fmt: skip
    md_args._check_sequence_parallel(te)  # (TE's layers cannot build here: the check alone)
    te.sequence_parallel = False
    with pytest.raises(SystemExit) as e:
        md_args._check_sequence_parallel(te)
    out = capsys.readouterr()
    msg = str(e.value.code) + out.err + out.out
    assert "needs --sequence-parallel: megatron's MoE" in msg and "local layer spec" not in msg


def test_md_under_expert_tensor_parallelism(capsys, monkeypatch):
    """Expert TP > 1 (experts split over megatron's expert-TP group) runs with AdamMD and
    MuonMD at TP 1 (megatron/md/tensor_parallel.py); MuonMD there needs the full-matrix
    Newton–Schulz as under TP, and Muown is refused."""
    monkeypatch.setenv("WORLD_SIZE", "2")
    etp = ["--md-decoupling", "--num-experts=4", "--expert-tensor-parallel-size=2",
           "--micro-batch-size=1"]  # fmt: skip
    for opt in ("adam", "muon"):
        args, md = parse(*etp, f"--optimizer={opt}", "--bf16")
        assert md is not None and args.expert_tensor_parallel_size == 2
    err = fails(capsys, *etp, "--optimizer=muon", "--muon-tp-mode=blockwise")
    assert "--muon-tp-mode duplicated" in err
    assert "(Muown) with (expert) TP > 1" in fails(capsys, *etp, "--optimizer=muown")


def test_distributed_optimizer_instances(capsys, monkeypatch):
    """--num-distributed-optimizer-instances: AdamMD's ZeRO-1 within each instance runs
    (tests/test_distributed_md.py, tests/test_distributed_checkpoint.py); what megatron-core
    0.19.2 asserts after the build or per rank, and what MD cannot sum over, is named first
    (each seen by hand, 2026-11-29, 4 ranks: the layer-wise assert after the model's build)."""
    monkeypatch.setenv("WORLD_SIZE", "8")
    base = ["--md-decoupling", "--use-distributed-optimizer", "--micro-batch-size=1",
            "--global-batch-size=8"]  # fmt: skip
    args, md = parse(*base, "--num-distributed-optimizer-instances=2")
    assert md is not None and args.num_distributed_optimizer_instances == 2
    parse(
        *base,
        "--num-distributed-optimizer-instances=4",
        "--tensor-model-parallel-size=2",
        "--num-query-groups=2",
        "--global-batch-size=4",
    )  # one data-parallel rank per instance: MD's TP × DP group is the instance's
    for extra, needle in (
        (["--num-distributed-optimizer-instances=3"], "does not divide the 8 data-parallel"),
        (
            ["--optimizer=muon", "--bf16", "--num-distributed-optimizer-instances=2"],
            "its layer-wise optimizer, which Muon and --md-adam-layer-wise use, asserts one",
        ),
        (["--md-adam-layer-wise", "--num-distributed-optimizer-instances=2"], "asserts one"),
        (
            [
                "--tensor-model-parallel-size=2",
                "--num-query-groups=2",
                "--num-distributed-optimizer-instances=2",
                "--global-batch-size=4",
            ],
            "with TP 2: MD sums its partials over megatron's TP × data-parallel group",
        ),
        (
            [
                "--num-experts=4",
                "--expert-model-parallel-size=4",
                "--num-distributed-optimizer-instances=4",
            ],
            "divide the 2 expert data-parallel",
        ),
    ):
        assert needle in fails(capsys, *base, *extra)
    plain = [a for a in base if a != "--md-decoupling"]
    assert "splits megatron's ZeRO-1" in fails(
        capsys, *plain[1:], "--num-distributed-optimizer-instances=2"
    )


def test_save_or_load_pointing_at_a_file(capsys, tmp_path):
    f = tmp_path / "ckpt"
    f.write_text("precious\n")
    for flag in ("--save", "--load"):
        assert f"{flag} {f} is a file" in fails(capsys, f"{flag}={f}")
    assert f.read_text() == "precious\n"  # untouched


def test_a_load_with_nothing_to_resume_is_refused_unless_it_is_the_save(capsys, tmp_path):
    """megatron starts from random weights when --load holds no tracker: a first start when
    --load is the run's own --save (the launcher's), a silent restart from scratch when it is
    one iteration directory or a mistyped path. --ckpt-step and a tracker are found at the load."""
    run, SI = tmp_path / "run", "--save-interval=10"
    (run / "iter_0000010").mkdir(parents=True)
    (run / "iter_0000010" / ".metadata").write_bytes(b"x")
    err = fails(capsys, f"--load={run}/iter_0000010", f"--save={run}", SI)
    assert f"is one saved iteration, not a run directory: give its run directory (--load {run} " \
           "--ckpt-step 10)" in err  # fmt: skip
    err = fails(capsys, f"--load={run}", f"--save={tmp_path}/new", SI)  # the tracker lost
    assert f"--load {run}: it holds iter_0000010 but no latest_checkpointed_iteration.txt" in err
    err = fails(capsys, f"--load={tmp_path}/rnu", f"--save={tmp_path}/new", SI)
    assert f"--load {tmp_path}/rnu: no such directory; megatron would start from random" in err
    new = tmp_path / "new"
    parse(f"--load={new}", f"--save={new}/", SI)  # a first start, resumed in place later
    parse(f"--load={run}", "--ckpt-step=10")  # (found, or refused, at the load)
    (run / "latest_checkpointed_iteration.txt").write_text("10")
    parse(f"--load={run}", f"--save={new}", SI)
    import megatron.training.global_vars as gv  # the authors' paths, on their cluster:

    gv.unset_global_variables()  # (tools/from_authors.py --check) not looked at
    pg.parse([*BASE, "--load=/their/run", "--save=/their/other", SI], True, check_save=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"]  # nothing made


def test_a_save_over_a_run_this_one_does_not_resume_is_refused(capsys, tmp_path):
    """megatron saves iter_N and rewrites the tracker in --save whatever it holds: a new run
    given an earlier run's directory would replace that run's checkpoints and tracker."""
    old, other, SI = tmp_path / "old", tmp_path / "other", "--save-interval=10"
    for run in (old, other):
        (run / "iter_0000030").mkdir(parents=True)
        (run / "iter_0000030" / ".metadata").write_bytes(b"x")
        (run / "latest_checkpointed_iteration.txt").write_text("30")
    err = fails(capsys, f"--save={old}", SI)
    assert f"--save {old} holds another run's checkpoints (its tracker names 30) and this run " \
           "has no --load: its saves would write over them" in err  # fmt: skip
    err = fails(capsys, f"--save={old}", f"--load={other}", SI)
    assert f"this run resumes --load {other}: its saves would write over them" in err
    parse(f"--save={old}/", f"--load={old}", SI)  # resuming it
    (tmp_path / "link").symlink_to(old)
    parse(f"--save={tmp_path}/link", f"--load={old}", SI)  # (one directory)
    assert (old / "latest_checkpointed_iteration.txt").read_text() == "30"


def test_a_save_directory_that_cannot_be_written_is_refused_at_start(capsys, tmp_path):
    """Megatron creates --save at the first save: a path it cannot create would end the run
    there, after --save-interval iterations. /proc takes no new directory (Linux, root too);
    a file inside the path. A writable path parses and nothing is left behind."""
    err = fails(capsys, "--save=/proc/md-run/ckpt")
    assert "--save /proc/md-run/ckpt: cannot write in /proc (" in err
    (tmp_path / "afile").write_text("precious\n")
    err = fails(capsys, f"--save={tmp_path}/afile/run")
    assert f"{tmp_path}/afile is a file, not a directory" in err
    args, _ = parse(f"--save={tmp_path}/new/run", "--save-interval=2")
    assert args.save == f"{tmp_path}/new/run"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["afile"]  # no probe, no directory
    assert (tmp_path / "afile").read_text() == "precious\n"


def build_dataset(prefix, docs, dtype=None):
    import numpy as np
    import torch
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    b = IndexedDatasetBuilder(f"{prefix}.bin", dtype=dtype or np.uint16)
    for doc in docs:
        b.add_item(torch.tensor(doc))
        b.end_document()
    b.finalize(f"{prefix}.idx")
    return prefix


def test_bad_datasets_are_named(capsys, tmp_path):
    """Empty, truncated and corrupt .idx/.bin pairs, and token ids beyond the vocabulary, stop
    before anything is built, naming the file; a good pair passes."""
    base = [a for a in BASE if a != "--mock-data"]
    good = build_dataset(tmp_path / "good", [[1, 2, 3, 4] * 50, [5, 6, 7] * 40])
    args, _ = parse(f"--data-path={good}", base=base)
    assert args.data_path == [str(good)]

    def msg(prefix):
        return fails(capsys, f"--data-path={prefix}", base=base)

    empty = tmp_path / "empty"
    (tmp_path / "empty.bin").write_bytes(b"")
    (tmp_path / "empty.idx").write_bytes(b"")
    assert "empty.idx is 0 bytes: empty or truncated" in msg(empty)
    none = build_dataset(tmp_path / "none", [])
    assert "holds no sequences" in msg(none)
    cut = build_dataset(tmp_path / "cut", [[1, 2, 3] * 100])
    data = (tmp_path / "cut.bin").read_bytes()
    (tmp_path / "cut.bin").write_bytes(data[: len(data) // 2])
    assert "cut.bin is 300 bytes but its index says 600" in msg(cut)
    bad = build_dataset(tmp_path / "bad", [[1, 2, 3]])
    idx = (tmp_path / "bad.idx").read_bytes()
    (tmp_path / "bad.idx").write_bytes(b"GARBAGE!!" + idx[9:])
    assert "bad.idx is not a megatron index file" in msg(bad)
    (tmp_path / "bad.idx").write_bytes(idx[:-5])
    assert "bad.idx is corrupt or truncated" in msg(bad)
    big = build_dataset(tmp_path / "big", [[1, 2, 5000, 3]])  # --vocab-size=1024 in BASE
    assert "holds token id 5000 but the tokenizer has 1025 tokens" in msg(big)
    # one dataset per split (megatron's --train/valid/test-data-path): each checked, named by
    # its flag (a missing one stopped the run with megatron's traceback after the model was
    # built; checked by hand, 2026-11-28)
    split = [f"--train-data-path={good}", f"--valid-data-path={good}"]
    args, _ = parse(*split, f"--test-data-path={good}", base=base)
    assert args.valid_data_path == [str(good)]
    said = fails(capsys, *split, f"--test-data-path={tmp_path}/gone", base=base)
    assert said.startswith(f"pretrain_gpt.py: error: --test-data-path: {tmp_path}/gone.bin does ")
    blend = ["--valid-data-path", "1", str(good), "1", str(big)]  # a blend for one split
    assert "holds token id 5000" in fails(capsys, f"--train-data-path={good}", *blend, base=base)
    # megatron's files of prefixes (--data-args-path; --per-split-data-args-path, JSON) were
    # refused as no data at all; now read as megatron reads them and checked the same way
    listed = tmp_path / "data_args.txt"
    listed.write_text(f"0.5 {good}\n0.5 {good}\n")
    args, _ = parse(f"--data-args-path={listed}", "--split=98,2,0", base=base)
    assert args.data_args_path == str(listed)
    assert "needs --split" in fails(capsys, f"--data-args-path={listed}", base=base)
    per_split = tmp_path / "per_split.json"
    per_split.write_text(json.dumps({"train": str(good), "valid": [str(good)], "test": f"1 {big}"}))
    said = fails(capsys, f"--per-split-data-args-path={per_split}", base=base)
    assert said.startswith(f"pretrain_gpt.py: error: --per-split-data-args-path {per_split} (test)")
    assert "holds token id 5000" in said
    per_split.write_text(json.dumps({"train": str(good), "valid": str(good), "test": None}))
    args, _ = parse(f"--per-split-data-args-path={per_split}", base=base)  # no test split
    per_split.write_text(json.dumps({"train": str(good)}))
    said = fails(capsys, f"--per-split-data-args-path={per_split}", base=base)
    assert "cannot be read as megatron reads it (KeyError: 'valid')" in said


def test_token_scan_runs_once_per_node(capsys, tmp_path, monkeypatch):
    """Only local rank 0 of a node scans the tokens (the other ranks check headers and sizes):
    at local rank 1 the out-of-vocabulary id passes, a truncated pair still stops."""
    base = [a for a in BASE if a != "--mock-data"]
    big = build_dataset(tmp_path / "big", [[1, 2, 5000, 3]])
    monkeypatch.setenv("LOCAL_RANK", "1")
    args, _ = parse(f"--data-path={big}", base=base)
    assert args.data_path == [str(big)]
    (tmp_path / "big.bin").write_bytes((tmp_path / "big.bin").read_bytes()[:4])
    assert "big.bin is 4 bytes but its index says" in fails(capsys, f"--data-path={big}", base=base)


def test_scaled_output_init_lowers_shape_up_and_qkv_split_follows_megatron():
    """MoE appendix: --scaled-output-init (σ/sqrt(2L) output projections) reaches the MD config
    as their init scale; MuonMD and AdamMD split Q/K/V unless --muon-no-split-qkv (upstream's
    default; the authors' optimizer splits for Adam too: feat/md-decoupling-optimizer,
    md_decoupling.py _normalize)."""
    _, md = parse("--md-decoupling", "--optimizer=muon", "--scaled-output-init")
    assert md.residual_init_scale == pytest.approx(1 / math.sqrt(2 * 4)) and md.split_qkv
    _, md = parse("--md-decoupling", "--optimizer=muon", "--muon-no-split-qkv")
    assert not md.split_qkv and md.residual_init_scale == 1.0
    _, md = parse("--md-decoupling", "--optimizer=adam")
    assert md.split_qkv
    _, md = parse("--md-decoupling", "--optimizer=adam", "--muon-no-split-qkv")
    assert not md.split_qkv


def test_paper_architecture_is_explicit_and_announced():
    """The paper's GPT comes with --paper-arch (every preset implies it); without it the model
    is megatron's own. The start-up banner lists every default that differs from upstream."""
    from megatron.md.train import startup

    args, md = parse("--md-decoupling", "--optimizer=muon")
    assert args.paper_arch and args.sandwich_norm and args.embedding_scale
    text = startup.banner(args, md)
    for what in ("Sandwich Norm", "sqrt(d)", "init std 1/sqrt(d)", "weight decay 0", "sphere_rms"):
        assert what in text, (what, text)
    sizes = ["--num-layers=2", "--hidden-size=64", "--num-attention-heads=2"]
    base = [a for a in BASE if not a.startswith("--preset")] + sizes
    args, md = parse(base=base)
    assert not (args.paper_arch or args.sandwich_norm or args.embedding_scale)
    assert args.init_method_std == 0.02 and md is None
    # what remains: megatron-core 0.19.2 has no --eval-interval default and fails without one
    assert [flag for _, flag in startup.differences(args, md)] == ["--eval-interval"]
    args, _ = parse("--no-sandwich-norm")
    assert (
        args.paper_arch and not args.sandwich_norm and "Sandwich" not in startup.banner(args, None)
    )
    assert "never run by the maintainers" not in startup.banner(args, None)  # the CPU path
    args.transformer_impl = "transformer_engine"
    args.distributed_backend, args.sequence_parallel = "nccl", True
    with pytest.MonkeyPatch.context() as m:
        m.setenv("WORLD_SIZE", "16")
        m.setenv("LOCAL_WORLD_SIZE", "8")
        line = startup.banner(args, None).splitlines()[-1]
    assert line.startswith("[megatron-md] never run by the maintainers: Transformer Engine")
    assert "several nodes; NCCL with more than one rank" in line and "sequence parallel" in line
    from megatron.md.config import MDConfig

    args.load = "/some/run"  # run on one GPU, one rank, through a --load: not named there
    with pytest.MonkeyPatch.context() as m:
        m.setenv("WORLD_SIZE", "1")
        assert "CUDA graph" not in startup.banner(args, MDConfig(cuda_graph=True))
        m.setenv("WORLD_SIZE", "2")
        line = startup.banner(args, MDConfig(cuda_graph=True)).splitlines()[-1]
    assert line.endswith("the MD step in a CUDA graph with more than one rank (--md-cuda-graph)")


def test_weights_only_resume_and_save_are_announced(tmp_path):
    """--no-load-optim continues the LR schedule where megatron restarts it (a row of the
    differences where --load holds a checkpoint, with megatron's --finetune as the new
    schedule); --no-save-optim warns that its checkpoints resume only with a fresh optimizer
    (under MD without the gains)."""
    from megatron.md.train import startup

    args, md = parse("--md-decoupling", "--optimizer=muon")
    assert "--no-load-optim" not in startup.banner(args, md)
    args.load, args.no_load_optim = str(tmp_path), True
    assert "--no-load-optim" not in startup.banner(args, md)  # a first launch: nothing to resume
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("10")
    assert ("--finetune: iteration 0, a new schedule") in [
        f for _, f in startup.differences(args, md)
    ]
    args.finetune = True
    assert "--no-load-optim" not in startup.banner(args, md)
    args.save, args.no_save_optim = "ckpt", True
    assert "--no-save-optim: the checkpoints hold the weights only (no optimizer state, no LR " \
        "schedule; not MD's gains and radii): a resume from them needs --no-load-optim" in \
        startup.banner(args, md)  # fmt: skip
    assert "gains" not in startup.banner(args, None).split("--no-save-optim")[1]


def test_weights_only_resume_continues_the_schedule_where_the_checkpoint_left_it():
    """schedule.continue_after_weights_only on megatron's own scheduler: at the saved step
    (the checkpoint's num_steps; where it saved none, the samples trained on but the skipped
    ones), with this run's values, or the checkpoint's with
    --use-checkpoint-opt_param-scheduler; nothing under --finetune or a loaded schedule."""
    import types

    import torch
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    from megatron.md.train import schedule

    def scheduler(lr=1e-2, steps=100):
        opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=lr)
        return OptimizerParamScheduler(
            opt, init_lr=0.0, max_lr=lr, min_lr=0.0, lr_warmup_steps=0, lr_decay_steps=steps,
            lr_decay_style="linear", start_wd=0.0, end_wd=0.0, wd_incr_steps=steps,
            wd_incr_style="constant",
        )  # fmt: skip

    args = types.SimpleNamespace(finetune=False, no_load_optim=True, consumed_train_samples=48,
                                 skipped_train_samples=8)  # fmt: skip
    saved = scheduler(lr=4e-2)
    saved.step(30)
    common = {"opt_param_scheduler": saved.state_dict()}
    s = scheduler()
    assert "(30 samples, iteration 5;" in schedule.continue_after_weights_only(s, common, args, 5)
    assert s.num_steps == 30 and s.optimizer.param_groups[0]["lr"] == pytest.approx(7e-3)
    s = scheduler()  # saved with --no-save-optim: no schedule in it
    schedule.continue_after_weights_only(s, {}, args, 5)
    assert s.num_steps == 40 and s.optimizer.param_groups[0]["lr"] == pytest.approx(6e-3)
    args.use_checkpoint_opt_param_scheduler = True
    s = scheduler()
    assert "the checkpoint's LR schedule" in schedule.continue_after_weights_only(
        s, common, args, 5)  # fmt: skip
    assert s.num_steps == 30 and s.optimizer.param_groups[0]["lr"] == pytest.approx(2.8e-2)
    for done in ({"finetune": True}, {"no_load_optim": False}):
        s = scheduler()
        assert schedule.continue_after_weights_only(
            s, common, types.SimpleNamespace(**{**vars(args), **done}), 5) is None  # fmt: skip
        assert s.num_steps == 0


def test_torchrun_killing_the_ranks_after_a_signal_is_named(monkeypatch):
    """torchrun kills its ranks 30 s after passing on a SIGTERM unless told to wait longer
    (TORCH_ELASTIC_SHUTDOWN_TIMEOUT, torch >= 2.12, or megatron.md.torchrun on any torch;
    launch.sbatch sets it and starts that): a run that saves on a signal is warned at start-up
    where the wait is not set or cannot be."""
    import dataclasses
    import types

    from torch.distributed.launcher import api

    from megatron.md.torchrun import reads_timeout
    from megatron.md.train import startup

    if not reads_timeout():  # a torch before 2.12 (NGC 25.10's 2.9): a stand-in of 2.12's
        new = dataclasses.make_dataclass("LaunchConfig", [("shutdown_timeout", int)])
        monkeypatch.setattr(api, "LaunchConfig", new)
    args = types.SimpleNamespace(exit_signal_handler=True)
    monkeypatch.delenv("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", raising=False)
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    assert startup.stop_grace(args) is None  # not torchrun's rank
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "7")
    warning = startup.stop_grace(args)
    assert "kills the ranks 30 s after a stop signal" in warning
    assert warning.endswith("set TORCH_ELASTIC_SHUTDOWN_TIMEOUT (seconds; launch.sbatch sets 1800)")
    assert startup.stop_grace(types.SimpleNamespace(exit_signal_handler=False)) is None
    monkeypatch.setenv("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", "1800")
    assert startup.stop_grace(args) is None
    # a torch before 2.12 (stand-in: its LaunchConfig had no shutdown_timeout): nothing to set
    old = dataclasses.make_dataclass("LaunchConfig", [("min_nodes", int), ("max_nodes", int)])
    monkeypatch.setattr(api, "LaunchConfig", old)
    assert "torchrun has no setting for it: start python -m megatron.md.torchrun" in (
        startup.stop_grace(args)
    )
    monkeypatch.setenv("MEGATRON_MD_TORCHRUN_GRACE", "1800")  # megatron.md.torchrun gave it
    assert startup.stop_grace(args) is None


def test_decoupled_lr_is_refused_with_the_flags_to_use(capsys):
    out = fails(capsys, "--decoupled-lr=1e-3")
    assert "--embedding-lr and --output-lr" in out


def test_stack_check_names_a_megatron_core_mismatch(monkeypatch):
    from megatron.md import stack

    assert stack.problems() == []  # this environment: megatron-core 0.19.2
    monkeypatch.setattr(stack, "version", lambda d: "0.17.0" if d == "megatron-core" else "1")
    (msg,) = stack.problems()
    assert "megatron-core 0.17.0 is installed" in msg and "0.19.2" in msg
    if stack.versions()["transformer-engine"] is None:
        monkeypatch.undo()
        (msg,) = stack.problems("transformer_engine")
        assert "Transformer Engine is not installed" in msg and "--transformer-impl local" in msg


def test_container_install_keeps_the_environments_torch():
    """container/install.sh pins the environment's torch (and TE, apex, ...) as constraints:
    resolving our requirements, the data and analysis extras included (tokenizers,
    transformers, matplotlib: present in the test venv), then installs nothing but megatron-md
    (dry run, no index)."""
    import os
    import subprocess

    env = {**os.environ, "PYTHON": sys.executable, "PIP_NO_INDEX": "1"}
    out = subprocess.run(["bash", str(ROOT / "container" / "install.sh"), "--dry-run"],
                         capture_output=True, text=True, env=env, timeout=300)  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    assert "[install]   torch==" in out.stderr
    report = json.loads(out.stdout)
    assert set(report["install"][0]["requested_extras"]) == {"data", "analysis"}
    assert [i["metadata"]["name"] for i in report["install"]] == ["megatron-md"]


def test_md_flags_come_from_the_config_fields(capsys):
    """One --md-<field> flag per MDConfig field megatron's own flags do not set, its default the
    field's; the ones that had no flag before (gain LR multiplier, gain eps, lowrank init std)
    reach the config too; an optimizer MD does not support stops before anything is built."""
    from megatron.md.config import FROM_MEGATRON_FLAGS, MDConfig

    args, md = parse("--md-decoupling", "--md-gain-lr-mult=0.5", "--md-gain-eps=1e-6",
                     "--md-lowrank-init-std=0.1")  # fmt: skip
    assert (md.gain_lr_mult, md.gain_eps, md.lowrank_init_std) == (0.5, 1e-6, 0.1)
    for name in MDConfig.field_names():
        if name not in FROM_MEGATRON_FLAGS:
            assert hasattr(args, "md_" + name), name
    assert "works with --optimizer adam or muon" in fails(
        capsys, "--md-decoupling", "--optimizer=sgd"
    )


def test_fused_step_flag_forms():
    for extra, expect in (
        ((), "auto"),
        (("--md-fused-step",), "on"),
        (("--md-fused-step=off",), "off"),
    ):
        _, md = parse("--md-decoupling", *extra)
        assert md.fused_step == expect


def test_the_papers_methods_by_name(capsys):
    """--optimizer adamw / adammd / muonmd are the paper's methods: megatron's adam (AdamW) and
    the two flags of AdamMD and MuonMD (the MD recipe with them, the radius --md-decoupling's;
    later flags win); a name neither megatron's nor ours is refused by argparse, listing
    ours with megatron's."""
    args, _ = parse("--optimizer=adamw")
    assert (args.optimizer, args.md_decoupling, args.weight_decay) == ("adam", False, 0.01)
    for name, base in (("adammd", "adam"), ("muonmd", "muon")):
        args, md = parse("--optimizer", name)
        assert (args.optimizer, args.md_decoupling, args.weight_decay) == (base, True, 0)
        assert md.radius == "init" and args.adam_beta2 == 0.99
    _, md = parse("--optimizer=muonmd", "--md-radius=shape")
    assert md.radius == "shape"
    out = fails(capsys, "--optimizer=muon_md")
    assert "invalid choice: 'muon_md'" in out
    assert all(f"'{n}'" in out for n in ("adam", "muon", "adamw", "adammd", "muonmd", "muown"))


def test_optimizer_muown(capsys):
    """--optimizer muown is Muon with MD's machinery in Muown's per-row form; the angular variant
    by --md-variant; a Muown variant with Adam is refused."""
    args, md = parse("--optimizer=muown")
    assert args.optimizer == "muon" and args.md_decoupling and md.variant == "muown"
    _, md = parse("--optimizer", "muown", "--md-variant=muown-angular")
    assert md.variant == "muown-angular"
    assert "is a Muon variant" in fails(capsys, "--md-decoupling", "--md-variant=muown")


def test_optimizer_muonh(capsys):
    """--optimizer muonh is MuonH on MD's machinery: the Frobenius sphere at the init norm, no
    gains, the hyperball scale (tests/test_reference.py: equal to emerging-optimizers'
    MuonHyperball); the hyperball scale without MD is refused (it follows the sphere)."""
    args, md = parse("--optimizer", "muonh")
    assert args.optimizer == "muon" and args.md_decoupling and args.weight_decay == 0
    assert (md.sphere, md.radius, md.gains, md.muon_scale) == (
        "frobenius", "init", "none", "hyperball")  # fmt: skip
    assert "hyperball needs --md-decoupling" in fails(
        capsys, "--optimizer=muon", "--muon-scale-mode=hyperball"
    )


def test_the_authors_flags_translate_and_run_here(capsys):
    """Their MoE MuonMD recipe (feat/scaling-sweeps recipes/master.sh) becomes ours and parses
    to the recipe's MD config: Muon base, Frobenius sphere at sqrt(max) (their projection at
    the start), unit embedding/LM-head rows, router rows, row+column softplus gains, the
    scaled output projections; their row mode is unit rows; flags with no equivalent are
    refused by name (docs/flags.md has the table)."""
    from megatron.md.train.authors import Untranslatable, translate

    master = ["--optimizer", "master", "--use-orthogonal-updates", "--ademamix-alpha", "0",
              "--hypersphere-mode", "flat", "--hypersphere-embedding-mode", "row",
              "--hypersphere-gains-mode", "rowcol", "--hypersphere-gains-mode-embedding", "none",
              "--muon-momentum", "0.95", "--muon-nesterov", "--muon-scale-mode", "shape_up",
              "--matrix-lr", "1e-2", "--embedding-lr", "1e-3", "--gains-lr", "1e-3",
              "--output-lr", "1e-3", "--router-use-orthogonal-updates", "true",
              "--hypersphere-router-mode", "row", "--min-lr-mode", "absolute",
              "--hypersphere-scale-out-proj-init", "--gain-parametrization",
              "softplus"]  # fmt: skip
    ours = translate(master)
    args, md = parse(*ours)
    assert args.optimizer == "muon" and args.md_decoupling and args.matrix_lr == 1e-2
    assert (md.sphere, md.radius, md.gains, md.gain_map, md.gain_lr) == (
        "frobenius", "shape", "rowcol", "softplus", 1e-3)  # fmt: skip
    assert (md.embedding_norm, md.output_norm, md.router_norm, md.output_gains) == (
        "row", "row", "row", "matrix")  # fmt: skip
    assert md.muon_scale == "shape_up" and md.residual_init_scale < 1
    row = translate(["--optimizer=md_decoupling", "--hypersphere-mode=row"])
    assert "--md-radius=unit" in row and "--md-gains=none" in row and "--optimizer=adam" in row
    for bad, says in (
        (["--optimizer=master", "--master-use-normuon"], "--master-use-normuon"),
        (["--optimizer=master", "--hypersphere-mode=spectral"], "mode spectral"),
        (["--optimizer=lion"], "--optimizer lion"),
        (["--optimizer=adam", "--hypersphere-mode=flat"], "without --optimizer"),
    ):
        with pytest.raises(Untranslatable, match=says):  # fmt: skip
            translate(bad)


def test_normuon_is_megatrons_adaptive_muon_and_what_it_cannot_do_is_refused(capsys, monkeypatch):
    """--optimizer normuon = megatron's adaptive_muon with the per-neuron second moment
    (NorMuon, emerging-optimizers 0.3.0); AdaMuon's elementwise moment (megatron's default
    method) would lose Muon's scale through megatron's TP wrapper and is refused by name, as
    NorMuon under TP (never run) and MD on it."""
    args, md = parse("--optimizer", "normuon")
    assert (args.optimizer, args.adaptive_muon_moment2_method, md) == (
        "adaptive_muon", "normuon", None)  # fmt: skip
    assert (args.adaptive_muon_beta2, args.adaptive_muon_eps) == (0.95, 1e-8)
    assert "use --optimizer normuon" in fails(capsys, "--optimizer=adaptive_muon")
    assert "--md-decoupling works with --optimizer adam or muon" in fails(
        capsys, "--optimizer=normuon", "--md-decoupling"
    )
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert "normuon under tensor parallelism" in fails(
        capsys, "--optimizer=normuon", "--tensor-model-parallel-size=2"
    )


def test_parsing_opens_no_wandb_run_and_writes_no_tensorboard_file(tmp_path, monkeypatch):
    """megatron opens its TensorBoard and wandb writers while parsing; a parse that only checks
    flags (``tools/from_authors.py --check`` with the authors' --wandb-project and paths, the
    sweep front-end) opened a wandb run and wrote under their --save. The writers are opened by
    ``pretrain_gpt.py`` after its start-up checks (``wandbrun.open_writers``)."""
    import megatron.training.global_vars as gv

    from megatron.md.train import wandbrun

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    save = tmp_path / "their_save"
    args, _ = parse("--wandb-project=p", f"--save={save}", "--save-interval=2",
                    f"--wandb-save-dir={tmp_path / 'wb'}")  # fmt: skip
    assert gv.get_tensorboard_writer() is None and gv.get_wandb_writer() is None
    assert list(tmp_path.iterdir()) == []
    wandbrun.open_writers(args)
    try:
        assert gv.get_tensorboard_writer() is not None and gv.get_wandb_writer() is not None
        assert len(list((save / "tensorboard").glob("events.out.tfevents.*"))) == 1
        assert len(list((tmp_path / "wb" / "wandb").glob("offline-run-*"))) == 1
        # a continued run's config holds its earlier launch's values (wandb_run.py,
        # _set_run_obj); megatron's later update of one without allow_val_change (pretrain,
        # slurm_job_name) raised where the value changed: settled first, it does not
        config = gv.get_wandb_writer().config
        config._update({"slurm_job_name": "earlier-job"}, allow_val_change=True)
        import wandb

        with pytest.raises(wandb.sdk.lib.config_util.ConfigError):
            config.update({"slurm_job_name": "N/A"})
        monkeypatch.delenv("SLURM_JOB_NAME", raising=False)
        wandbrun.settle_config()
        config.update({"slurm_job_name": "N/A"})  # megatron's line
    finally:
        gv.get_wandb_writer().finish()
        gv.get_tensorboard_writer().close()


def test_a_dataset_cache_that_cannot_be_created_is_named(capsys, tmp_path):
    """megatron writes the dataset indices into --data-cache-path (default: beside the data)
    when they are not cached yet, after building the model and loading the checkpoint; a
    directory that cannot be created stops at start-up, naming it (here a file in its path:
    root ignores permissions). A creatable one passes and is not created."""
    base = [a for a in BASE if a != "--mock-data"]
    good = build_dataset(tmp_path / "c", [[1, 2, 3, 4] * 50, [5, 6, 7] * 40])
    (tmp_path / "afile").write_text("")
    msg = fails(capsys, f"--data-path={good}", f"--data-cache-path={tmp_path}/afile/cache",
                base=base)  # fmt: skip
    assert (f"--data-cache-path {tmp_path}/afile/cache cannot be created ({tmp_path}/afile is "
            "not a directory)") in msg, msg  # fmt: skip
    args, _ = parse(f"--data-path={good}", f"--data-cache-path={tmp_path}/new/cache", base=base)
    assert not (tmp_path / "new").exists()
    Path(str(good)).write_text("")  # a file where the default cache's directory goes
    msg = fails(capsys, f"--data-path={good}", base=base)
    assert (f"--data-path's cache, beside the data, {good}/cache/GPTDataset_indices cannot be "
            f"created ({good} is not a directory)") in msg, msg  # fmt: skip


def test_a_finished_marker_is_removed_only_for_a_run_that_trains_further(tmp_path, monkeypatch):
    """cli.clear_finished: kept where the run asks no more iterations (by count or by samples,
    as megatron's update_train_iters counts them); removed where it asks more, or unreadable."""
    from types import SimpleNamespace

    from megatron.md.train import cli

    monkeypatch.setenv("RANK", "0")
    marker = tmp_path / "finished"
    a = SimpleNamespace(save=str(tmp_path), train_iters=10, train_samples=None,
                        global_batch_size=8, step_batch_size_schedule=None)  # fmt: skip
    for train_iters, samples, text, kept in [(10, None, "10\n", True), (None, 80, "10\n", True),
                                             (11, None, "10\n", False), (None, 88, "10\n", False),
                                             (10, None, "", False)]:  # fmt: skip
        marker.write_text(text)
        a.train_iters, a.train_samples = train_iters, samples
        line = cli.clear_finished(a)
        assert marker.exists() == kept and (line is None) == kept, (train_iters, samples, text)
    monkeypatch.setenv("RANK", "1")  # rank 0's to do
    marker.write_text("1\n")
    assert cli.clear_finished(a) is None and marker.exists()


@pytest.mark.parametrize("flag", ["--metrics-file", "--tensorboard-dir", "--wandb-save-dir"])
def test_a_log_directory_that_cannot_be_written_is_named_at_start_up(capsys, tmp_path, flag):
    """Under a file: each failed with a traceback when the run opened its logs (measured,
    2026-11-28: --metrics-file FileExistsError, --tensorboard-dir NotADirectoryError)."""
    (tmp_path / "afile").write_text("")
    path = tmp_path / "afile" / "logs"
    msg = fails(capsys, f"{flag}={path}")
    assert (
        f"{flag} {path.parent if flag == '--metrics-file' else path}: {tmp_path / 'afile'} "
        "is a file, not a directory" in msg
    ), msg


def test_a_dataset_flag_megatron_no_longer_has_stops_at_start(capsys, monkeypatch):
    """A megatron-core whose parser lost a flag data.DATASET_FLAGS maps stops at start-up,
    naming it (it would fail as the datasets are built, after the model)."""
    from megatron.md.train import data

    monkeypatch.setattr(data, "DATASET_FLAGS", {**data.DATASET_FLAGS, "gone_flag": "x"})
    assert "megatron's parser no longer has gone_flag" in fails(capsys)


def test_the_dense_presets_scale_rope_as_the_authors_dense_runs(capsys):
    """The paper's dense presets turn Llama 3.x RoPE scaling on (factor 8), as the authors'
    dense runs (gainz submissions/submit.sh: --use-rope-scaling; megatron's factor default 8);
    the MoE ladder, the 150M re-warming model and the laptop presets do not (feat/scaling-sweeps
    lib/common.sh has none); --no-rope-scaling is the paper's text; with megatron's own
    --use-rope-scaling it contradicts, refused."""
    from megatron.md.train.presets import PRESETS

    scaled = {n for n in PRESETS if "--rope-scaling" in PRESETS[n].flags()}
    assert scaled == {n for n in PRESETS if n.startswith("dense-") and n != "dense-150M"}
    dense = [f for f in BASE if not f.startswith("--preset")] + ["--preset=dense-181M"]
    from megatron.md.export import hf_export

    args, _ = parse(base=dense)
    assert args.use_rope_scaling is True and args.rope_scaling_factor == 8.0
    assert hf_export.config(args)["rope_scaling_factor"] == 8.0  # what the export writes
    args, _ = parse("--no-rope-scaling", base=dense)
    assert args.use_rope_scaling is False and hf_export.config(args)["rope_scaling_factor"] is None
    args, _ = parse("--rope-scaling")  # tiny: off unless asked
    assert args.use_rope_scaling is True and parse()[0].use_rope_scaling is False
    msg = fails(capsys, "--use-rope-scaling", "--no-rope-scaling", base=dense)
    assert "--use-rope-scaling and --no-rope-scaling contradict each other" in msg


def test_an_moe_checkpoint_loads_into_the_layers_that_saved_it():
    """An MoE checkpoint saved by Transformer Engine's layers into the local spec's, or the
    other way, is refused by name before anything is read (the pre-MLP norm's name differs:
    megatron's load would stop on a list of missing keys); a dense model's, the same
    implementation's, and the evaluation's local rebuild of a TE run (``te_names``) pass."""
    from megatron.md.train import ckpt_checks

    ckpt = ckpt_checks.Checkpoint("/runs/moe/iter_0000100", "torch_dist")
    te, local = (argparse.Namespace(transformer_impl=i) for i in ("transformer_engine", "local"))
    moe = {"num_experts": 8}
    for saved, now in ((te, local), (local, te)):
        with pytest.raises(SystemExit) as e:
            ckpt_checks.check_layer_impl(ckpt, saved, argparse.Namespace(**vars(now), **moe))
        msg = str(e.value.code)
        assert f"saved by the {saved.transformer_impl} layers" in msg
        assert f"give --transformer-impl {saved.transformer_impl}" in msg
        assert "nothing was read or changed" in msg
        ckpt_checks.check_layer_impl(ckpt, saved, argparse.Namespace(**vars(now), num_experts=None))
        ckpt_checks.check_layer_impl(ckpt, saved, argparse.Namespace(**vars(saved), **moe))
    ckpt_checks.check_layer_impl(ckpt, te, argparse.Namespace(**vars(local), **moe, te_names=True))


def test_a_tools_extra_flags_reach_a_plain_method_without_the_md_steps():
    """tools/throughput.py and tools/fb_dispatch.py give their extra flags to every method; a
    plain method (no --md-decoupling), which refuses the MD step's flags, gets the others."""
    from megatron.md.train import recipes
    from megatron.md.train.args import extra_for

    extra = ["--bf16", "--md-fused-step", "on", "--md-gain-lr=1e-3", "--md-tangent-grad",
             "--seq-length=32", "--md-log-interval=5"]  # fmt: skip
    plain = ["--bf16", "--seq-length=32", "--md-log-interval=5"]
    assert extra_for(recipes.dense_recipe("adamw", 1e-3), extra) == plain
    assert extra_for(recipes.dense_recipe("muonmd", 1e-3), extra) == extra
    assert extra_for(["--optimizer", "adammd"], extra) == extra  # an MD method by its name
    assert extra_for(["--optimizer=normuon"], extra) == plain
    args, _ = parse(*recipes.dense_recipe("muon", 1e-3), *extra_for(["--optimizer=muon"], extra))
    assert not args.md_decoupling and args.seq_length == 32


def test_a_resumed_run_keeps_its_block_output_scale():
    """A run resuming its own checkpoint with another block-output scale (Sandwich Norm's α, α
    alone, or none) is refused before anything is read, naming the flags that restore it; a
    checkpoint older than --prenorm-block-scale had none; --init-from and --finetune may
    change it; α after a Sandwich norm is compared only where both have the norm."""
    from megatron.md.train import ckpt_checks

    ckpt = ckpt_checks.Checkpoint("/runs/a/iter_0000100", "torch_dist")
    old = argparse.Namespace(sandwich_norm=False, block_output_scale="1/L")  # before the flag
    now = argparse.Namespace(sandwich_norm=False, block_output_scale="1/L", finetune=False,
                             prenorm_block_scale="1/sqrt(2L)")  # fmt: skip
    with pytest.raises(SystemExit) as e:
        ckpt_checks.check_block_scale(ckpt, old, now)
    msg = str(e.value.code)
    assert "its blocks were trained with another output scale (prenorm_block_scale: " in msg
    assert "checkpoint None, this run '1/sqrt(2L)'" in msg and "(drop --prenorm-block-scale)" in msg
    ckpt_checks.check_block_scale(ckpt, old, argparse.Namespace(**{**vars(now), "finetune": True}))
    new_run = ckpt_checks.Checkpoint("/runs/a/iter_0000100", "torch_dist", flag="--init-from")
    ckpt_checks.check_block_scale(new_run, old, now)
    scaled = argparse.Namespace(**{**vars(now), "block_output_scale": "1"})
    ckpt_checks.check_block_scale(ckpt, scaled, now)  # no Sandwich Norm: its α is unread
    sandwich = argparse.Namespace(sandwich_norm=True, block_output_scale="1/L")
    with pytest.raises(SystemExit, match=r"\(--block-output-scale=1/L\)"):
        ckpt_checks.check_block_scale(
            ckpt,
            sandwich,
            argparse.Namespace(
                **{**vars(sandwich), "block_output_scale": "1/sqrt(2L)", "finetune": False}
            ),
        )
    with pytest.raises(SystemExit, match=r"\(--sandwich-norm; drop --prenorm-block-scale\)"):
        ckpt_checks.check_block_scale(ckpt, sandwich, now)


def test_a_resumed_run_keeps_its_position_encoding(capsys):
    """A run resuming its own checkpoint (--load) under other RoPE settings is refused before
    anything is read, naming each difference and the flags that restore the checkpoint's (a run
    started before the dense presets scaled RoPE resumes with --no-rope-scaling); a new run
    from the checkpoint (--init-from) or --finetune may change them; the factor matters only
    where both scale."""
    from megatron.md.train import ckpt_checks

    saved = argparse.Namespace(position_embedding_type="rope", rotary_base=500000,
                               rotary_percent=1.0, use_rope_scaling=False,
                               rope_scaling_factor=8.0)  # fmt: skip
    now = argparse.Namespace(**{**vars(saved), "use_rope_scaling": True, "finetune": False})
    ckpt = ckpt_checks.Checkpoint("/runs/a/iter_0000100", "torch_dist")
    with pytest.raises(SystemExit) as e:
        ckpt_checks.check_positions(ckpt, saved, now)
    msg = str(e.value.code)
    assert "--load: checkpoint /runs/a/iter_0000100: it was trained with another position" in msg
    assert "use_rope_scaling: checkpoint False, this run True" in msg
    assert "(--no-rope-scaling;" in msg and "nothing was read or changed" in msg
    ckpt_checks.check_positions(ckpt, saved, argparse.Namespace(**{**vars(now), "finetune": True}))
    new_run = ckpt_checks.Checkpoint("/runs/a/iter_0000100", "torch_dist", flag="--init-from")
    ckpt_checks.check_positions(new_run, saved, now)
    same = argparse.Namespace(**{**vars(saved), "finetune": False, "rope_scaling_factor": 4.0})
    ckpt_checks.check_positions(ckpt, saved, same)  # no scaling on either side: factor unread
    both = argparse.Namespace(**{**vars(saved), "use_rope_scaling": True})
    with pytest.raises(SystemExit, match=r"--rope-scaling-factor=8.0"):
        ckpt_checks.check_positions(
            ckpt, both, argparse.Namespace(**{**vars(same), "use_rope_scaling": True})
        )
    with pytest.raises(SystemExit, match=r"--rotary-base=500000"):
        ckpt_checks.check_positions(
            ckpt, saved, argparse.Namespace(**{**vars(same), "rotary_base": 10000})
        )

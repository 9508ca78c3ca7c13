"""``pretrain_gpt.py``'s model (megatron/md/train/model.py) is megatron-core's own GPT for the
flags megatron's own builder reads (training/models/gpt.py ``GPTModelBuilder``, from
training/argument_utils.py ``gpt_config_from_args``): built both ways in one process, the
parameters and the logits are equal. ``--use-rope-scaling``,
``--rotary-seq-len-interpolation-factor`` and ``--qk-l2-norm`` were parsed and ignored; the
flags for models the provider does not build are refused. Under context parallelism the forward
step feeds each rank its chunks of the sequence, as megatron's own does."""

import inspect
import sys

import pytest
import torch
from test_pretrain_flags import BASE, fails, parse

from megatron.md.train import model as md_model

#: what the paper adds to megatron's GPT (--paper-arch: Sandwich Norm, embeddings × sqrt(d),
#: every matrix at init std 1/sqrt(d)), off: what is left is megatron's own model
MEGATRONS = ["--no-sandwich-norm", "--no-embedding-scale", "--scaled-output-init"]


@pytest.fixture
def one_process(monkeypatch):
    import megatron.training.global_vars as gv

    from megatron.md.testing import one_process_group

    for k, v in dict(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0").items():
        monkeypatch.setenv(k, v)
    monkeypatch.setattr(sys, "argv", ["pretrain_gpt.py"])
    one_process_group()
    yield
    gv.unset_global_variables()


def _build_both(*flags):
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from megatron.training.argument_utils import gpt_config_from_args
    from megatron.training.arguments import core_transformer_config_from_args
    from megatron.training.models.gpt import GPTModelBuilder

    args, _ = parse(*MEGATRONS, *flags)
    args.padded_vocab_size = args.vocab_size  # (megatron's tokenizer set-up sets it)
    built = []
    for build in (
        lambda: md_model.model_provider(),
        lambda: GPTModelBuilder(
            gpt_config_from_args(args, core_transformer_config_from_args(args))
        ).build_model(ProcessGroupCollection.use_mpu_process_groups()),
    ):
        torch.manual_seed(5)
        model_parallel_cuda_manual_seed(5)
        built.append(build().eval())
    return args, built


@pytest.mark.usefixtures("one_process")
@pytest.mark.parametrize(
    "flags",
    [
        [],
        ["--use-rope-scaling"],
        ["--rotary-seq-len-interpolation-factor=2"],
        ["--preset=tiny-moe", "--qk-l2-norm"],
    ],
)
def test_the_model_is_megatrons_own_gpt_for_its_flags(flags):
    args, (ours, megatrons) = _build_both(*flags)
    mine = dict(ours.named_parameters())
    theirs = dict(megatrons.named_parameters())
    assert mine.keys() == theirs.keys()
    assert all(torch.equal(mine[k], theirs[k]) for k in mine)
    tokens = torch.randint(0, args.vocab_size, (2, args.seq_length))
    position = torch.arange(args.seq_length).expand(2, -1)
    with torch.no_grad():
        a, b = (m(tokens, position, None) for m in (ours, megatrons))
    assert torch.equal(a, b)
    if flags:  # the flag changes the model (so its being dropped would show here): its
        # logits, or its parameters (--qk-l2-norm drops the query/key RMSNorm weights, whose
        # init of 1 gives L2Norm's numbers bit for bit)
        _, (plain, _) = _build_both(*[f for f in flags if f.startswith("--preset")])
        with torch.no_grad():
            same = torch.equal(plain(tokens, position, None), a)
        assert not same or dict(plain.named_parameters()).keys() != mine.keys()


@pytest.mark.usefixtures("one_process")
def test_qk_l2_norm_reaches_the_dense_layers():
    """megatron's builder passes ``qk_l2_norm`` to its MoE block spec and its Transformer
    Engine layer spec but not to its local layer spec (training/models/gpt.py,
    ``_te_or_local_layer_spec``); here every spec gets it: the queries' and keys' norm is
    megatron-core's L2Norm (in place of the RMSNorm ``--qk-layernorm`` gives)."""
    from megatron.core.transformer.torch_norm import L2Norm

    _, (ours, megatrons) = _build_both("--qk-l2-norm")
    for layer in ours.decoder.layers:
        attention = layer.self_attention
        assert isinstance(attention.q_layernorm, L2Norm)
        assert isinstance(attention.k_layernorm, L2Norm)
    assert not isinstance(megatrons.decoder.layers[0].self_attention.q_layernorm, L2Norm)


@pytest.mark.usefixtures("one_process")
def test_the_rope_scaling_factor_reaches_the_model():
    """megatron's builder leaves ``rope_scaling_factor`` at its default (8); the flag counts
    here."""
    inv = []
    for factor in ("8", "2"):
        args, _ = parse(*MEGATRONS, "--use-rope-scaling", f"--rope-scaling-factor={factor}")
        args.padded_vocab_size = args.vocab_size
        inv.append(md_model.model_provider().rotary_pos_emb.inv_freq)
        import megatron.training.global_vars as gv

        gv.unset_global_variables()
    assert not torch.equal(*inv)


@pytest.mark.usefixtures("one_process")
def test_the_prenorm_block_scale_multiplies_each_block_output_before_its_residual_add(capsys):
    """``--prenorm-block-scale`` (the authors' ``--fixed-layer-scale`` without ``--post-norm``,
    gainz exp3-depth-transfer.sh's exp3-depth-prenorm loop): megatron's own GPT, the same
    parameters, where each attention and MLP output enters the residual stream times α =
    1/sqrt(2L), no norm between (bit for bit the product and the add, layer by layer). With
    Sandwich Norm, or ``--block-output-scale`` without it, the flags are refused."""
    args, (ours, megatrons) = _build_both("--prenorm-block-scale=1/sqrt(2L)")
    alpha = 1 / (2 * args.num_layers) ** 0.5
    mine, theirs = dict(ours.named_parameters()), dict(megatrons.named_parameters())
    assert mine.keys() == theirs.keys() and all(torch.equal(mine[k], theirs[k]) for k in mine)
    seen = {}

    def keep(name):
        def hook(module, inputs, kwargs, output):
            x = inputs[0] if inputs else kwargs["hidden_states"]
            seen[name] = (x, output[0] if isinstance(output, tuple) else output)

        return hook

    layer = ours.decoder.layers[1]
    for name in ("input_layernorm", "self_attention", "pre_mlp_layernorm", "mlp"):
        getattr(layer, name).register_forward_hook(keep(name), with_kwargs=True)
    layer.register_forward_hook(keep("layer"), with_kwargs=True)
    tokens = torch.randint(0, args.vocab_size, (2, args.seq_length))
    position = torch.arange(args.seq_length).expand(2, -1)
    with torch.no_grad():
        a, b = (m(tokens, position, None) for m in (ours, megatrons))
    assert not torch.equal(a, b)
    x = seen["input_layernorm"][0]
    after_attention = seen["pre_mlp_layernorm"][0]
    assert torch.equal(after_attention, x + alpha * seen["self_attention"][1])
    assert torch.equal(seen["layer"][1], after_attention + alpha * seen["mlp"][1])
    # the Hugging Face export computes it too (tools/export_hf.py's config and weights)
    from megatron.md.export import hf_export, hf_modeling

    cfg, weights = hf_export.config(args), hf_export.tensors(ours.state_dict())
    assert cfg["prenorm_block_scale"] == alpha and not cfg["sandwich_norm"]
    hf = hf_modeling.MegatronMDForCausalLM(hf_modeling.MegatronMDConfig(**cfg)).eval()
    hf.load_state_dict(weights)
    with torch.no_grad():
        theirs = hf(tokens).logits
    assert float((theirs - a).norm() / a.norm()) < 1e-5
    msg = fails(capsys, "--prenorm-block-scale=1/L")  # the preset's Sandwich Norm
    assert "add --no-sandwich-norm" in msg, msg
    msg = fails(capsys, "--no-sandwich-norm", "--block-output-scale=1/sqrt(2L)")
    assert "it would be ignored; a scale without the norm is --prenorm-block-scale" in msg, msg


@pytest.mark.parametrize("backend", ["local", "auto"])
def test_the_local_attention_backend_puts_megatrons_attention_in_the_layer(backend):
    """``--attention-backend local`` with the Transformer Engine spec: megatron's builder puts
    megatron-core's DotProductAttention in TE's place; so does ``layer_spec`` (TE cannot be
    installed here: a local spec whose attention is something else stands for TE's)."""
    from types import SimpleNamespace

    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnBackend

    spec = get_gpt_layer_local_spec()
    spec.submodules.self_attention.submodules.core_attention = torch.nn.Identity  # "TE's"
    md_model.local_attention(spec, SimpleNamespace(attention_backend=AttnBackend[backend]))
    got = spec.submodules.self_attention.submodules.core_attention
    assert got is (DotProductAttention if backend == "local" else torch.nn.Identity)


def test_every_gpt_model_argument_is_set_from_its_flag():
    """A GPTModel argument megatron-core adds fails here until the provider sets it from its
    flag (``GPT_FLAGS``) or refuses the model it asks for (``NOT_BUILT``)."""
    from megatron.core.models.gpt import GPTModel

    params = set(inspect.signature(GPTModel.__init__).parameters) - {"self"}
    by_the_provider = {
        *("config", "transformer_layer_spec", "vocab_size", "max_sequence_length"),
        *("pre_process", "post_process", "parallel_output", "share_embeddings_and_output_weights"),
        *("pg_collection", "vp_stage"),
    }
    left = {
        "mtp_block_spec",  # refused: --mtp-num-layers (NOT_BUILT)
        "scatter_embedding_sequence_parallel",  # no flag: megatron's builder's default
    }
    assert params == set(md_model.GPT_FLAGS) | by_the_provider | left


@pytest.mark.parametrize(
    "flag",
    [
        "--mtp-num-layers=1",
        "--spec",
        "--use-grouped-gemm-for-dense-mlp",
        "--transformer-impl=inference_optimized",
    ],
)
def test_a_model_the_provider_does_not_build_is_refused(capsys, flag):
    extra = [flag, "megatron.core.models.gpt.gpt_layer_specs"] if flag == "--spec" else [flag]
    msg = fails(capsys, *extra, base=BASE)
    said = f"{flag.split('=')[0]}: pretrain_gpt.py builds"
    if "transformer-impl" in flag:
        said = "--transformer-impl inference_optimized: pretrain_gpt.py builds"
    assert said in msg, msg


def test_a_yaml_config_is_refused_before_megatron_reads_it(capsys, tmp_path):
    """megatron's ``--yaml-cfg`` replaces the parsed flags with the file's (the presets' and
    MD's too): refused before megatron opens it."""
    msg = fails(capsys, f"--yaml-cfg={tmp_path / 'none.yaml'}")
    assert "--yaml-cfg: megatron then takes every setting from the YAML file" in msg, msg


@pytest.mark.distributed
def test_each_context_parallel_rank_gets_its_chunks_of_the_sequence(tmp_path):
    """CP 2 (2 gloo ranks): rank r's tokens, labels, loss mask and positions are chunks r and
    3 − r of the sequence's four (causal attention's work even across the ranks), the
    attention mask's query rows the same; megatron-core's CP attention takes this cut
    (Transformer Engine's: the local attention refuses CP, so no CP model runs here). Without
    it every rank fed the whole sequence."""
    import json
    import os
    import subprocess
    from pathlib import Path

    from megatron.md.launch import local_ranks

    script = Path(__file__).parent / "distributed" / "cp_batch_check.py"
    out = subprocess.run(local_ranks(script, 2), capture_output=True, text=True, timeout=300,
                         cwd=tmp_path, env={**os.environ, "OMP_NUM_THREADS": "1"})  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    got = dict(json.loads(out.stdout.strip().splitlines()[-1]))
    s, chunk = 16, 4
    for r in (0, 1):
        mine = [*range(r * chunk, (r + 1) * chunk), *range((3 - r) * chunk, (4 - r) * chunk)]
        batch = got[r]
        assert batch["position_ids"] == [mine, mine]
        assert batch["tokens"] == [mine, [100 + p for p in mine]]
        assert batch["labels"] == [[1000 + p for p in mine]] * 2
        assert batch["loss_mask"] == [[float(p % 3 != 0) for p in mine]] * 2
        rows = batch["attention_mask"][0][0]  # [queries of this rank, every key]
        assert rows == [[k <= q for k in range(s)] for q in mine]
    assert sorted(got[0]["position_ids"][0] + got[1]["position_ids"][0]) == list(range(s))


@pytest.mark.usefixtures("one_process")
def test_megatrons_rerun_machinery_sees_the_loss(tmp_path):
    """``--check-for-spiky-loss`` reports a loss 10× the largest of the first 100 (megatron's
    tracker file names it, at its iteration), and a NaN loss stops the step
    (``--check-for-nan-in-loss-and-grad``): the loss function hands each micro-batch's loss to
    megatron's rerun machinery, as megatron's own does (here with re-runs off, the machinery's
    plain check). Red without: nothing reported, nothing raised."""
    from megatron.core.rerun_state_machine import (
        RerunMode,
        destroy_rerun_state_machine,
        initialize_rerun_state_machine,
    )

    from megatron.md.train.data import loss_func

    parse("--check-for-spiky-loss")
    tracker = tmp_path / "rejected.txt"
    initialize_rerun_state_machine(
        mode=RerunMode.DISABLED, result_rejected_tracker_filename=str(tracker)
    )
    try:
        mask = torch.ones(2, 8)
        for i in range(100):  # the machinery's sample of the largest loss (1.0 per token)
            loss_func(mask, torch.full((2, 8), 1.0 - i / 1000))
        assert tracker.read_text() == ""  # (the machinery makes the file at its start)
        loss_func(mask, torch.full((2, 8), 9.0))  # 9× the largest: not a spike
        assert tracker.read_text() == ""
        loss_func(mask, torch.full((2, 8), 10.0))
        assert "message='Spiky loss'" in tracker.read_text()
        with pytest.raises(RuntimeError, match="found NaN in local forward loss calculation"):
            loss_func(mask, torch.full((2, 8), float("nan")))
    finally:
        destroy_rerun_state_machine()


@pytest.mark.usefixtures("one_process")
def test_a_transformer_engine_moe_checkpoint_names_the_local_moe_layers_pre_mlp_norm():
    """Evaluating a Transformer Engine run where TE does not load (evaluation/restore.py,
    ``local_for_te``): the local spec reads TE's checkpoint names — its norms' sharded keys are
    TE's fused ones (megatron's ``sharded_state_dict_keys_map``) — except an MoE layer's pre-MLP
    norm, which TE saves as ``pre_mlp_layernorm.weight`` and the local spec as a dense layer's
    fused norm: ``te_names`` gives the MoE layers TE's key, the dense first layer keeps its."""
    import megatron.training.global_vars as gv

    def saved_as(te_names: bool) -> list[tuple[str, str]]:
        args, _ = parse("--preset=tiny-moe")
        args.padded_vocab_size = args.vocab_size
        args.te_names = te_names
        sd = md_model.model_provider().sharded_state_dict()
        gv.unset_global_variables()
        return [tuple(sd[f"decoder.layers.{i}.{m}.weight"].key.split(".", 3)[-1]
                      for m in ("input_layernorm", "pre_mlp_layernorm"))
                for i in range(4)]  # fmt: skip

    qkv, fc1 = "self_attention.linear_qkv.layer_norm_weight", "mlp.linear_fc1.layer_norm_weight"
    assert saved_as(False) == [(qkv, fc1)] * 4
    assert saved_as(True) == [(qkv, fc1)] + [(qkv, "pre_mlp_layernorm.weight")] * 3

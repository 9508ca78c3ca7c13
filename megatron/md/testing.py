"""Builders shared by the tests, the step benchmark (tools/bench_md_step.py) and the examples:
a tiny paper-style GPT, and megatron-core's own DDP and optimizer around a module, in the
three layouts MD integrates with (ZeRO-1, layer-wise, replicated). Not used by training
(``pretrain_gpt.py`` builds through megatron.training)."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

DISTS = ("zero1", "layerwise", "replicated")


def one_process_group() -> None:
    """A one-process gloo group and megatron's model parallelism (1, 1), unless some are set up:
    what megatron-core wants before it builds a model."""
    from megatron.core import parallel_state as ps

    if not torch.distributed.is_initialized():  # megatron-core wants a process group
        # an in-memory store: a file:// one left a file in /tmp behind every process
        torch.distributed.init_process_group(
            "gloo", store=torch.distributed.HashStore(), rank=0, world_size=1
        )
    if not ps.model_parallel_is_initialized():
        ps.initialize_model_parallel(1, 1)


def tiny_gpt(seed: int, hidden: int, layers: int, seq: int, experts: int = 0, *,
             ffn: int | None = None, expert_ffn: int | None = None, vocab: int = 256):  # fmt: skip
    """Paper-style GPT on the local spec (4 heads, 2 query groups, SwiGLU, RMSNorm, QK-norm,
    RoPE, a byte vocabulary or ``vocab``, init std 1/sqrt(d), MLP ``ffn`` or 4 d);
    ``experts > 0``: DeepSeekMoE-style layers after the first (top-2 sigmoid router with
    expert bias, experts of ``expert_ffn`` or d, one shared expert at half that).
    Starts a one-process gloo group and megatron's model parallelism when none is set up;
    experts are split over megatron's expert-TP and expert-parallel groups (initialized by the
    caller)."""
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import (
        get_gpt_decoder_block_spec,
        get_gpt_layer_local_spec,
    )
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from megatron.core.transformer import TransformerConfig

    one_process_group()
    torch.default_generator.manual_seed(seed)
    model_parallel_cuda_manual_seed(seed)
    moe = {}
    if experts:
        moe = dict(
            num_moe_experts=experts,
            moe_layer_freq=[0] + [1] * (layers - 1),
            moe_ffn_hidden_size=expert_ffn or hidden,
            moe_shared_expert_intermediate_size=(expert_ffn or hidden) // 2,
            moe_router_topk=2,
            moe_router_score_function="sigmoid",
            moe_router_enable_expert_bias=True,
            moe_router_bias_update_rate=1e-3,
            moe_router_load_balancing_type="seq_aux_loss",
            moe_aux_loss_coeff=1e-3,
            moe_router_topk_scaling_factor=2.5,
            moe_router_dtype="fp32",
            moe_token_dispatcher_type="alltoall",
            moe_grouped_gemm=False,
            expert_tensor_parallel_size=ps.get_expert_tensor_parallel_world_size(),
            expert_model_parallel_size=ps.get_expert_model_parallel_world_size(),
        )
    cfg = TransformerConfig(
        num_layers=layers,
        hidden_size=hidden,
        ffn_hidden_size=ffn or 4 * hidden,
        num_attention_heads=4,
        num_query_groups=2,
        gated_linear_unit=True,
        activation_func=F.silu,
        bias_activation_fusion=False,
        add_bias_linear=False,
        normalization="RMSNorm",
        layernorm_epsilon=1e-5,
        qk_layernorm=True,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        init_method_std=1 / math.sqrt(hidden),
        use_cpu_initialization=True,
        tensor_model_parallel_size=ps.get_tensor_model_parallel_world_size(),
        **moe,
    )
    if experts:
        spec = get_gpt_decoder_block_spec(
            cfg, use_transformer_engine=False, normalization="RMSNorm"
        )
    else:
        spec = get_gpt_layer_local_spec(qk_layernorm=True, normalization="RMSNorm")
    return GPTModel(
        cfg,
        spec,
        vocab_size=vocab,
        max_sequence_length=seq,
        position_embedding_type="rope",
        rotary_base=500000,
        share_embeddings_and_output_weights=False,
    )


def megatron_optimizer(
    module, config, dist: str, world: int, optimizer: str, instances: int = 1,
    bucket_size: int | None = None, **opt_kwargs,
):  # fmt: skip
    """megatron's DDP around ``module`` and megatron's optimizer for it, as megatron.training
    builds them (not yet MD): ``dist`` zero1 (DistributedOptimizer), layerwise
    (LayerWiseDistributedOptimizer: megatron builds it for Muon only, so layer-wise AdamMD is
    built as Muon and swapped by ``enable_md``) or replicated; ``world``: the data-parallel
    size; ``instances``: megatron's ``num_distributed_optimizer_instances`` (ZeRO-1 within each
    of that many slices of the data-parallel ranks; its groups made by
    ``initialize_model_parallel``); ``bucket_size``: megatron's gradient buckets of about this
    many elements, with ``--overlap-grad-reduce`` as on a cluster (None: one bucket, no
    overlap; ZeRO-1 shards each bucket, so a rank's cut matrices grow with the buckets).
    ``opt_kwargs`` go to megatron's OptimizerConfig (lr, betas, muon_* ...).
    Returns (the DDP model, the optimizer)."""
    from megatron.core.distributed import DistributedDataParallel as DDP
    from megatron.core.distributed import DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.optimizer.layer_wise_optimizer import (
        LayerWiseDistributedOptimizer,
        tag_params_for_buffer_routing,
    )

    if dist not in DISTS:
        raise ValueError(f"dist {dist!r} is not one of {', '.join(DISTS)}")
    ddpc = DistributedDataParallelConfig(
        use_distributed_optimizer=dist != "replicated",
        grad_reduce_in_fp32=True,
        overlap_grad_reduce=bucket_size is not None,
        bucket_size=bucket_size,
        num_distributed_optimizer_instances=instances,
    )
    from megatron.core.transformer.module import Float16Module

    extra = {}
    if dist == "layerwise":
        inner = module.module if isinstance(module, Float16Module) else module
        tag_params_for_buffer_routing([inner])
        from megatron.core import parallel_state as ps

        edp = world  # the expert-DP size (megatron's groups, once initialized)
        if ps.model_parallel_is_initialized():
            edp = ps.get_expert_data_parallel_world_size()
        extra["full_param_layout"] = LayerWiseDistributedOptimizer.compute_full_param_layout(
            list(inner.parameters()), None, world, ddpc, expert_data_parallel_world_size=edp
        )
    dmodel = DDP(config, ddpc, module, **extra)
    cfg = OptimizerConfig(
        optimizer="muon" if dist == "layerwise" else optimizer,
        use_distributed_optimizer=dist != "replicated",
        use_layer_wise_distributed_optimizer=dist == "layerwise",
        **opt_kwargs,
    )
    return dmodel, get_megatron_optimizer(cfg, [dmodel])

"""Which megatron settings MD runs under: one check, shared by the flag parser
(``train/args.validate``, before anything is built) and ``enable_md`` (library code a user may
call from their own loop, after megatron built its optimizer). Each refusal is written once,
naming the flag to change.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Setup:
    """The megatron settings MD's support depends on, read off the flags (``from_args``) or
    off megatron's OptimizerConfig/DDPConfig and model (``from_megatron``)."""

    optimizer: str
    """megatron's optimizer: adam or muon (layer-wise AdamMD is built as muon)."""
    weight_decay: float
    """Decoupled weight decay of the matrices."""
    fp16: bool
    """fp16 training with loss scaling."""
    fsdp: bool = False
    """Megatron-FSDP or torch FSDP2."""
    precision_aware: bool = False
    """``--use-precision-aware-optimizer`` (main params not held by megatron in fp32)."""
    low_bit_param_gather: bool = False
    """fp8 or fp4 parameter all-gather."""
    tensor_parallel: bool = False
    """TP > 1 or expert TP > 1."""
    muon_tp_mode: str = "duplicated"
    """megatron's ``--muon-tp-mode``."""
    grouped_weight: str | None = None
    """What keeps every local expert in one parameter (a flag or a module name), if anything."""
    adam_layer_wise: bool = False
    """AdamMD owned layer-wise (``--md-adam-layer-wise``): the base step is Adam."""
    variant: str = "md"
    """``MDConfig.variant``."""

    @classmethod
    def from_args(cls, args) -> Setup:
        etp = args.expert_tensor_parallel_size or args.tensor_model_parallel_size
        flag = "--moe-single-grouped-weight"
        return cls(
            optimizer=args.optimizer,
            weight_decay=args.weight_decay,
            fp16=args.fp16,
            fsdp=bool(getattr(args, "use_megatron_fsdp", False))
            or bool(getattr(args, "use_torch_fsdp2", False)),
            precision_aware=bool(getattr(args, "use_precision_aware_optimizer", False)),
            tensor_parallel=args.tensor_model_parallel_size > 1
            or bool(args.num_experts and etp > 1),  # megatron's default ETP is the TP size
            muon_tp_mode=args.muon_tp_mode,
            grouped_weight=flag if getattr(args, "moe_single_grouped_weight", False) else None,
            adam_layer_wise=args.md_adam_layer_wise,
            variant=args.md_variant,
        )

    @classmethod
    def from_megatron(cls, config, ddp_config, md, tensor_parallel: bool):
        """``config``: a leaf optimizer's OptimizerConfig; ``ddp_config``: its DDPConfig or
        None; ``md``: the MDConfig. (The model's grouped weights ``enable_md`` checks per
        module: ``grouped_weight_refusal``.)"""
        low_bit = ddp_config is not None and bool(
            ddp_config.fp8_param_gather or ddp_config.fp4_param_gather
        )
        return cls(
            optimizer="muon" if "muon" in config.optimizer else config.optimizer,
            weight_decay=config.weight_decay,
            fp16=config.fp16,
            fsdp=ddp_config is not None and bool(getattr(ddp_config, "use_megatron_fsdp", False)),
            precision_aware=bool(getattr(config, "use_precision_aware_optimizer", False)),
            low_bit_param_gather=low_bit,
            tensor_parallel=tensor_parallel,
            muon_tp_mode=getattr(config, "muon_tp_mode", "duplicated"),
            adam_layer_wise=md.adam_layer_wise,
            variant=md.variant,
        )


def grouped_weight_refusal(where: str) -> str:
    """Why ``where`` (the flag, or a module with TE's ``single_grouped_weight``) is refused."""
    return (
        f"{where} keeps every local expert in one parameter (--moe-single-grouped-weight): MD "
        "needs one parameter per expert matrix; leave it off (TE's grouped GEMM then keeps one "
        "parameter per expert, weight0 ... weight{E-1})"
    )


def refusal(s: Setup) -> str | None:
    """Why MD cannot run under ``s`` (the first reason), or None."""
    muon_md = s.optimizer == "muon" and not s.adam_layer_wise
    if s.fp16:
        return "MD does not support --fp16 (use --bf16): loss scaling would hit the gains"
    if s.weight_decay:
        return (
            f"MD keeps matrices on a sphere: --weight-decay must be 0 with --md-decoupling "
            f"(got {s.weight_decay})"
        )
    if s.fsdp:
        return "MD does not support FSDP (Megatron-FSDP or FSDP2): use --use-distributed-optimizer"
    if s.precision_aware:
        return "MD needs fp32 main params held by megatron: drop --use-precision-aware-optimizer"
    if s.low_bit_param_gather:
        return "MD does not support fp8/fp4 param gather"
    if s.grouped_weight is not None:
        return grouped_weight_refusal(s.grouped_weight)
    if muon_md and s.tensor_parallel and s.variant != "md":
        return f"--md-variant {s.variant} (Muown) with (expert) TP > 1 is not supported"
    if muon_md and s.tensor_parallel and s.muon_tp_mode != "duplicated":
        return (
            "MuonMD with (expert) TP > 1 orthogonalizes each full matrix, as at TP=1: "
            f"--muon-tp-mode duplicated (got {s.muon_tp_mode}, which orthogonalizes each TP "
            "piece alone)"
        )
    return None


def check(s: Setup) -> None:
    """Raise ValueError with ``refusal(s)``, if any."""
    why = refusal(s)
    if why is not None:
        raise ValueError(why)

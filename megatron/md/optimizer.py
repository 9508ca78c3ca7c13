"""Single-process optimizer: AdamW, Muon, AdamMD or MuonMD over a model's parameter list.

Matrices go through the reference MD step (``reference.md_step``) on top of the base optimizer;
embeddings / LM head / router get their row constraints; 1-D parameters get plain Adam. With
``md=None`` it is the plain baseline (decoupled weight decay on matrices). The demo trains with
it and the distributed tests use it as their oracle.
"""

from __future__ import annotations

from typing import Iterable

import torch

from megatron.md import reference
from megatron.md.base_steps import (
    AdamHParams,
    MuonHParams,
    adam_step_,
    muon_scale_factor,
    muon_update,
)
from megatron.md.config import MDConfig, spec_for
from megatron.md.roles import param_role, qkv_blocks, residual_write


def model_param_groups(
    model: torch.nn.Module,
    lr: float,
    embedding_lr: float | None = None,
    output_lr: float | None = None,
) -> list[dict]:
    """One param group per role, with the paper's per-group LRs (others follow ``lr``); each
    group lists its parameters' names (``names``) for the per-matrix MD choices."""
    lrs = {"embedding": embedding_lr or lr, "output": output_lr or lr}
    groups: dict[str, dict] = {}
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        role = param_role(name, p)
        g = groups.setdefault(
            role, {"params": [], "names": [], "role": role, "lr": lrs.get(role, lr)}
        )
        g["params"].append(p)
        g["names"].append(name)
    return list(groups.values())


class MDOptimizer(torch.optim.Optimizer):
    """AdamW / Muon, each optionally with MD decoupling (``md`` not None)."""

    def __init__(
        self,
        params: Iterable,
        md: MDConfig | None = None,
        base: str = "adam",
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.99),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        muon_momentum: float = 0.95,
        muon_nesterov: bool = True,
        muon_ns_steps: int = 5,
        muon_scale: str = "unit_rms_norm",
        fp32_matmul_prec: str = "highest",
    ):
        if base not in ("adam", "muon"):
            raise ValueError(f"--optimizer={base!r} is not one of adam, muon")
        if md is not None and weight_decay != 0:
            raise ValueError(
                "MD keeps matrices on a sphere: use --weight-decay 0 with --md-decoupling"
            )
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, role="matrix")
        super().__init__(params, defaults)
        self.md, self.base = md, base
        self.muon = dict(
            momentum=muon_momentum,
            nesterov=muon_nesterov,
            ns_steps=muon_ns_steps,
            fp32_matmul_prec=fp32_matmul_prec,
        )
        self.muon_scale = muon_scale

    def _adam_hp(self, group: dict, lr: float | None = None, wd: float = 0.0) -> AdamHParams:
        b1, b2 = group["betas"]
        return AdamHParams(group["lr"] if lr is None else lr, b1, b2, group["eps"], wd)

    @torch.no_grad()
    def step(self, closure=None):
        if closure is not None:
            raise ValueError("closure is not supported")
        for group in self.param_groups:
            role = group["role"]
            names = group.get("names") or [""] * len(group["params"])
            for p, name in zip(group["params"], names):
                if p.grad is None:
                    continue
                st = self.state[p]
                if role == "vector" or (self.md is None and role != "matrix"):
                    self._plain_adam(p, st, group)
                elif self.md is None:
                    self._plain_matrix(p, st, group)
                else:
                    self._md(p, st, group, role, name)
        return None

    def _plain_adam(self, p, st, group) -> None:
        if not st:
            st.update(step=0, exp_avg=torch.zeros_like(p), exp_avg_sq=torch.zeros_like(p))
        st["step"] += 1
        wd = group["weight_decay"] if self.md is None else 0.0
        adam_step_(
            p, p.grad, st["exp_avg"], st["exp_avg_sq"], st["step"], self._adam_hp(group, wd=wd)
        )

    def _plain_matrix(self, p, st, group) -> None:
        if self.base == "adam":
            return self._plain_adam(p, st, group)
        if not st:
            st["momentum_buffer"] = torch.zeros_like(p)
        hp = MuonHParams(lr=group["lr"], **self.muon)
        blocks = qkv_blocks(p)  # megatron's default Q/K/V split, where tagged
        rows = [p.shape[0] * n // sum(blocks) for n in blocks] or [p.shape[0]]
        scale = [muon_scale_factor(self.muon_scale, r, p.shape[1]) for r in rows]
        upd = muon_update(p.grad, st["momentum_buffer"], hp, scale, blocks)
        if group["weight_decay"]:
            p.mul_(1 - group["lr"] * group["weight_decay"])
        p.add_(upd, alpha=-group["lr"])

    def _md(self, p, st, group, role, name: str = "") -> None:
        # Embeddings and LM head always use Adam (paper); matrices and router the chosen base.
        base = self.base if role in ("matrix", "router") else "adam"
        spec = spec_for(role, self.md, residual_write(name), qkv_blocks(p))
        if not st:
            st.update(reference.init_state(p, spec, base))
        if base == "adam":
            base_hp = self._adam_hp(group)
        else:
            base_hp = MuonHParams(lr=group["lr"], **self.muon)
        b1, b2 = self.md.gain_betas
        gain_hp = AdamHParams(self.md.gain_lr_for(group), b1, b2, self.md.gain_eps)
        reference.md_step(p, p.grad, st, spec, base_hp, gain_hp)

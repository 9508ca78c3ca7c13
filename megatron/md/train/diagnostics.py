"""The MD diagnostics of one optimizer step, on every run (MD or not, so baselines compare).

Per matrix class (``matrix_class``; mean over its matrices unless said otherwise):

- ``rel_update``: relative weight update ‖ΔW‖/‖W‖ with W the weights before the step (as the
  authors' runs: ‖W_new − W_old‖/‖W_old‖, gainz megatron/training/internals_logging/metrics.py,
  ``_relative_norm_change``), from the fp32 weights the optimizer holds (never bf16 model
  weights, whose rounding biases it upward at small LRs; the authors' runs read those);
- ``out_change``: relative change of a layer's output on the same input, ‖X ΔWᵀ‖/‖X Wᵀ‖ with
  W the weights before the step (the paper's transfer-dynamics figure; as the authors' runs:
  ‖Y_new − Y_old‖/‖Y_old‖, Y_old the forward pass's output: gainz
  megatron/training/internals_logging/logger.py, ``_compute_delta_y_metrics``). X: the first
  512 tokens of each rank's first micro-batch into the layer (attention and MLP linears outside
  routed experts, whose inputs depend on the routing); each rank measures the rows it owns on
  its own X (a ZeRO-1 cut row counts as two pieces), the sums are added over ranks; under
  tensor parallelism a row-parallel layer's partial outputs are first summed over its TP group
  (one all-reduce per such layer);
- ``rel_update_block``: ``rel_update`` of the fused QKV matrices' query, key and value blocks
  (``q``, ``k``, ``v``: each block's ‖ΔW‖/‖W‖, mean over layers; the paper's lr-decay figure
  reports the query block's), for every method;
- ``act_rms``: per-layer RMS of block outputs (first micro-batch);
- ``attn_logit_max``: per layer, the largest attention logit q·k·scale (the softmax's input:
  after RoPE and any QK norm) over heads and causal positions of the first sequence of the
  first micro-batch (the max over ranks under TP): "more stable" as a number, for every arm;
- MD runs: ``sphere_drift`` max |‖Ŵ‖−c|/c, gain spread (``raw_gain_norm``, ``gain_min``,
  ``gain_max``), and ``gains_by_layer``: per ``<class>/<layer>/<row|col>`` the raw-gain norm
  and the min and max effective gain (the paper's gain-dynamics figure).

One ``all_gather_object`` per diagnostic step (the last rank writes the merged result).
"""

from __future__ import annotations

import math
import re

import torch

from megatron.md import tensor_parallel
from megatron.md.roles import matrix_class, qkv_split_shapes

#: tokens of X kept per layer for the output change
OUT_TOKENS = 512
LINEARS = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")


def layer_of(name: str) -> int | None:
    m = re.search(r"layers\.(\d+)\.", name)
    return int(m.group(1)) if m else None


def unwrap(m):
    while hasattr(m, "module"):
        m = m.module
    return m


def global_param_names(model_chunks) -> dict:
    """Parameter -> name with megatron's global layer index (``TransformerLayer.layer_number``,
    1-based) in place of the chunk's local one: under pipeline parallelism every stage has a
    ``decoder.layers.0``, and the ranks' pieces are merged by name."""
    out = {}
    for chunk in model_chunks:
        module = unwrap(chunk)
        prefixes = {}
        for mname, mod in module.named_modules():
            m = re.fullmatch(r"(.*layers)\.(\d+)", mname)
            num = getattr(mod, "layer_number", None)
            if m and isinstance(num, int):
                prefixes[mname + "."] = f"{m.group(1)}.{num - 1}."
        for name, p in module.named_parameters():
            old = next((o for o in prefixes if name.startswith(o)), None)
            out[p] = name if old is None else prefixes[old] + name[len(old) :]
    return out


class StepDiagnostics:
    """Hooks on the model (activation RMS, layer inputs: recorded while ``due()``, i.e. on
    diagnostic iterations) and the measurements around one optimizer step."""

    def __init__(self, optimizer, model_chunks, due):
        self.opt, self.chunks, self.due = optimizer, model_chunks, due
        self.global_names = global_param_names(model_chunks)  # fixed for the run
        self.acts: dict[int, float] = {}
        self.logits: dict[int, float] = {}  # layer -> largest attention logit
        self.inputs: dict[torch.Tensor, torch.Tensor] = {}  # weight -> X (first micro-batch)
        config = getattr(unwrap(model_chunks[0]), "config", None) if model_chunks else None
        #: rows of one query group of the fused QKV weight: (q, k, v)
        self.qkv_rows = qkv_split_shapes(config) if config is not None else None
        for chunk in model_chunks:
            module = unwrap(chunk)
            decoder = getattr(module, "decoder", None)
            for i, layer in enumerate(getattr(decoder, "layers", [])):
                layer.register_forward_hook(self._act_hook(i))
                core = getattr(getattr(layer, "self_attention", None), "core_attention", None)
                if isinstance(core, torch.nn.Module):
                    core.register_forward_pre_hook(self._logit_hook(i), with_kwargs=True)
            for name, sub in module.named_modules():
                w = getattr(sub, "weight", None)
                fused_norm = "LayerNorm" in type(sub).__name__  # TE: X is before the norm
                if name.endswith(LINEARS) and ".experts." not in name and not fused_norm:
                    if isinstance(w, torch.Tensor) and w.ndim == 2:
                        sub.register_forward_pre_hook(self._input_hook(w))

    def _act_hook(self, i):
        def hook(module, inputs, output):
            if module.training and i not in self.acts and self.due():  # first micro-batch
                h = output[0] if isinstance(output, tuple) else output
                self.acts[i] = float(h.detach().float().pow(2).mean().sqrt())

        return hook

    def _logit_hook(self, i):
        def hook(module, args, kwargs):
            if not (module.training and i not in self.logits and self.due()):
                return
            q = args[0] if args else kwargs.get("query")
            k = args[1] if len(args) > 1 else kwargs.get("key")
            if isinstance(q, torch.Tensor) and isinstance(k, torch.Tensor) and q.dim() == 4:
                scale = getattr(module, "softmax_scale", None) or 1 / math.sqrt(q.shape[-1])
                self.logits[i] = max_attention_logit(q[:, 0], k[:, 0], float(scale))

        return hook

    def _input_hook(self, weight):
        def hook(module, inputs):
            if module.training and weight not in self.inputs and inputs and self.due():
                x = inputs[0].detach()
                self.inputs[weight] = x.reshape(-1, x.shape[-1])[:OUT_TOKENS].float().clone()

        return hook

    # ---- around the step ----
    def _names(self) -> dict:
        out = {}
        for p, name in self.global_names.items():
            cls = matrix_class(name) if p.ndim == 2 else None
            if cls is not None:
                out[p] = (name, cls)
        return out

    def _owned(self):
        """(leaf optimizer, main param, name, class) of every reported matrix this rank steps."""
        from megatron.md.leaves import leaf_optimizers
        from megatron.md.mains import main_params

        names = self._names()
        for opt in leaf_optimizers(self.opt):
            for mp in main_params(opt):
                if mp.model in names:
                    yield opt, mp, *names[mp.model]

    @torch.no_grad()
    def before_step(self) -> dict:
        """The fp32 weights this rank steps (ZeRO-1 slices / whole matrices)."""
        from megatron.md.mains import fp32_weight

        return {(n, _piece(mp)): fp32_weight(o, mp).clone() for o, mp, n, _ in self._owned()}

    @torch.no_grad()
    def after_step(self, before: dict) -> dict:
        from megatron.md.mains import fp32_weight

        parts = []
        for opt, mp, name, cls in self._owned():
            w = fp32_weight(opt, mp)
            old = before[(name, _piece(mp))]
            dw = w - old
            out = self._out_change(mp, old, dw)
            blocks = self._qkv_sq(mp, old, dw) if cls == "qkv" else None
            parts.append((name, cls, _piece(mp), _sq(dw), _sq(old), out, blocks))
        gathered = [None] * torch.distributed.get_world_size()
        local = _md_local(self.opt, self.global_names)
        torch.distributed.all_gather_object(gathered, (parts, local, self.logits))
        result = _merge_updates([p for p, _, _ in gathered])
        result.update(_md_merge([m for _, m, _ in gathered]))
        result["act_rms"] = [self.acts[i] for i in sorted(self.acts)]
        logits: dict[int, float] = {}
        for _, _, per_rank in gathered:  # TP ranks hold other heads: the max over them
            for i, v in per_rank.items():
                logits[i] = max(v, logits.get(i, -math.inf))
        if logits:
            result["attn_logit_max"] = [logits[i] for i in sorted(logits)]
        self.acts, self.logits, self.inputs = {}, {}, {}
        return result

    def _qkv_sq(self, mp, w: torch.Tensor, dw: torch.Tensor):
        """(‖ΔW_b‖², ‖W_b‖²) for the q, k, v blocks b of this rank's piece of a fused QKV
        matrix (rows interleaved per query group, as megatron lays them out); None when the
        piece is not whole query groups."""
        from megatron.md.blocks import slice_blocks

        shape = tuple(mp.model.shape)
        if self.qkv_rows is None or shape[0] % sum(self.qkv_rows):
            return None
        period = sum(self.qkv_rows)
        pattern = torch.repeat_interleave(torch.arange(3), torch.tensor(self.qkv_rows))
        sums = torch.zeros(2, 3, dtype=torch.float64)
        for blk in slice_blocks(shape, mp.start, mp.start + w.numel()):
            ids = pattern[torch.arange(blk.r0, blk.r0 + blk.nr) % period]
            for k, t in enumerate((dw, w)):
                rows = blk.view(t).double().square().sum(1).cpu()
                sums[k].index_add_(0, ids, rows)
        return sums[0].tolist(), sums[1].tolist()

    def _out_change(self, mp, w: torch.Tensor, dw: torch.Tensor):
        """(‖X ΔWᵀ‖², ‖X Wᵀ‖²) over the rows of this rank's piece (``w``: before the step), or
        None."""
        from megatron.md.blocks import slice_blocks

        x = self.inputs.get(mp.model)
        if x is None:
            return None
        outs = []  # X ΔWᵀ and X Wᵀ on the rows of each block
        for blk in slice_blocks(tuple(mp.model.shape), mp.start, mp.start + w.numel()):
            xs = x[:, blk.c0 : blk.c0 + blk.nc].to(w.device)
            outs += [xs @ blk.view(dw).T, xs @ blk.view(w).T]
        group = tensor_parallel.row_parallel_group(mp.model)
        if group is not None:  # this rank's columns give a partial output: sum over TP first
            flat = torch.cat([o.reshape(-1) for o in outs])
            torch.distributed.all_reduce(flat, group=group)
            outs = list(flat.split([o.numel() for o in outs]))
        return sum(map(_sq, outs[0::2])), sum(map(_sq, outs[1::2]))


@torch.no_grad()
def max_attention_logit(q: torch.Tensor, k: torch.Tensor, scale: float) -> float:
    """The largest q·k·scale over heads and causal positions of one sequence: ``q`` (s, heads,
    d), ``k`` (s, groups, d) with megatron's GQA layout (query head h reads key group
    h // (heads / groups)); one head at a time, so an (s, s) block at most."""
    s, heads = q.shape[0], q.shape[1]
    rep = heads // k.shape[1]
    causal = torch.ones(s, s, dtype=torch.bool, device=q.device).tril()
    best = torch.full((), -math.inf, device=q.device)
    for h in range(heads):
        sc = (q[:, h].float() @ k[:, h // rep].float().T) * scale
        best = torch.maximum(best, sc.masked_fill(~causal, -math.inf).max())
    return float(best)


def _piece(mp) -> tuple[int, int]:
    """A main param's piece of its matrix: (TP piece, ZeRO-1 offset); replicas share it."""
    return tensor_parallel.piece_rank(mp.model), mp.start


def _sq(t: torch.Tensor) -> float:
    d = t.double().reshape(-1)  # one float64 copy (square().sum() made two)
    return float(torch.dot(d, d))


def _merge_updates(gathered: list[list]) -> dict:
    """Relative update and output change per class from every rank's pieces (replicas of one
    piece counted once)."""
    pieces: dict[tuple, dict] = {}
    for rank_parts in gathered:
        for name, cls, start, dw2, w2, out, blocks in rank_parts:
            pieces.setdefault((name, cls), {})[start] = (dw2, w2, out, blocks)
    rel: dict[str, list[float]] = {}
    change: dict[str, list[float]] = {}
    per_block: dict[str, list[float]] = {}
    for (_, cls), by_start in pieces.items():
        dw2 = sum(v[0] for v in by_start.values())
        w2 = sum(v[1] for v in by_start.values())
        rel.setdefault(cls, []).append(math.sqrt(dw2 / max(w2, 1e-60)))
        blocks = [v[3] for v in by_start.values()]
        if blocks and all(b is not None for b in blocks):
            for i, b in enumerate("qkv"):
                d = sum(x[0][i] for x in blocks)
                n = sum(x[1][i] for x in blocks)
                per_block.setdefault(b, []).append(math.sqrt(d / max(n, 1e-60)))
        outs = [v[2] for v in by_start.values() if v[2] is not None]
        if outs:
            num, den = sum(o[0] for o in outs), sum(o[1] for o in outs)
            change.setdefault(cls, []).append(math.sqrt(num / max(den, 1e-60)))
    out = {"rel_update": {c: sum(v) / len(v) for c, v in rel.items()}}
    if per_block:
        out["rel_update_block"] = {b: sum(v) / len(v) for b, v in per_block.items()}
    if change:
        out["out_change"] = {c: sum(v) / len(v) for c, v in change.items()}
    return out


def _md_local(optimizer, names: dict) -> list[dict]:
    """This rank's sphere-norm partials and gain statistics of every MD matrix it steps
    (``names``: global parameter names, ``global_param_names``)."""
    from megatron.md import maps
    from megatron.md.leaves import leaf_optimizers

    local = []
    for o in leaf_optimizers(optimizer):
        inner = o.optimizer
        if not hasattr(inner, "slots"):
            continue
        for p, slot in inner.slots.items():
            md, st = slot.md, inner.md_state[p]
            part = []  # this slice's squared-norm partials, as numbers (no norm: none)
            if md.n_norm:
                tmp = torch.zeros(md.n_norm, dtype=torch.float32, device=p.device)
                md.norm_partials(inner.direction_of(p), tmp)
                part = tmp.tolist()
            axes = {}
            for n in md.gain_names:
                if n in ("gain_row", "gain_col", "gain_scalar"):
                    g = st[n]
                    phi = maps.phi(g, md.spec.gain_map)
                    axes[n[5:]] = (_sq(g), float(phi.min()), float(phi.max()))
            radius = st.get("radius")
            local.append(  # numbers, not tensors: all_gather_object pickles a tensor with
                {  # torch.save and reads it back with torch.load (weights_only), per tensor
                    "name": names.get(slot.model_param, slot.name),
                    "start": (md.tp.rank if md.tp else 0, md.start),
                    "partial": part,
                    "radius": None if radius is None else radius.detach().reshape(-1).tolist(),
                    "axes": axes,
                }
            )
    return local


def _md_merge(gathered: list[list[dict]]) -> dict:
    """Sphere drift and gain spread per class, gains per layer and axis."""
    by_name: dict[str, dict] = {}
    for rank_items in gathered:
        for it in rank_items:
            e = by_name.setdefault(it["name"], {"slices": {}, **it})
            e["slices"][it["start"]] = it["partial"]  # replicas of one slice counted once
    drift, raw, gmin, gmax, by_layer = {}, {}, {}, {}, {}
    for name, e in by_name.items():
        cls = matrix_class(name) or "other"
        if e["radius"] is not None and e["slices"]:
            norm = torch.tensor(list(e["slices"].values()), dtype=torch.float64).sum(0).sqrt()
            r = torch.tensor(e["radius"], dtype=torch.float64)
            drift[cls] = max(drift.get(cls, 0.0), float(((norm - r).abs() / r).max()))
        if e["axes"]:
            raw.setdefault(cls, []).append(math.sqrt(sum(a[0] for a in e["axes"].values())))
            gmin[cls] = min(gmin.get(cls, math.inf), *(a[1] for a in e["axes"].values()))
            gmax[cls] = max(gmax.get(cls, -math.inf), *(a[2] for a in e["axes"].values()))
            layer = layer_of(name)
            if layer is not None and cls in ("qkv", "proj", "fc1", "fc2"):
                for axis, (sq, lo, hi) in e["axes"].items():
                    by_layer[f"{cls}/{layer}/{axis}"] = [math.sqrt(sq), lo, hi]
    out = {
        "sphere_drift": drift,
        "raw_gain_norm": {c: sum(v) / len(v) for c, v in raw.items()},
        "gain_min": gmin,
        "gain_max": gmax,
        "gains_by_layer": by_layer,
    }
    return {k: v for k, v in out.items() if v}

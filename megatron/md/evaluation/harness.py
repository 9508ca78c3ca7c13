"""An lm-evaluation-harness ``LM`` over any causal model that maps token ids ``[b, s]`` to
logits ``[b, s, V]``: log-likelihoods of continuations (multiple-choice tasks: MMLU,
HellaSwag, ARC, WinoGrande) and rolling log-likelihoods of whole texts (perplexity), batched.
Generation is not provided (the paper's zero-shot set needs none).

A continuation is scored as megatron scores a sample: the model reads context + continuation
less its last token, truncated on the left to ``max_length`` tokens, and the log-softmax of the
last ``len(continuation)`` positions picks the continuation's tokens (fp32). Rolling scores use
lm-eval's disjoint windows of ``max_length`` tokens, each predicting every one of its tokens.
"""

from __future__ import annotations

from typing import Callable

import torch
from lm_eval.api.model import TemplateLM
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window


class MegatronLM(TemplateLM):
    """``forward(tokens) -> logits``; ``encode(text) -> ids`` (no special tokens added);
    ``eod``: the token that separates documents (also the empty context's stand-in)."""

    def __init__(
        self,
        forward: Callable[[torch.Tensor], torch.Tensor],
        encode: Callable[[str], list[int]],
        eod: int,
        max_length: int,
        batch_size: int = 8,
        device: str | torch.device = "cpu",
    ):
        super().__init__()
        self._forward, self._encode, self._eod = forward, encode, eod
        self.max_length, self.batch_size, self._device = max_length, batch_size, device
        self.rows_read = 0  # sequences the model has read (each a row of a batch)
        self.requests = 0  # (context, continuation) pairs scored

    @property
    def eot_token_id(self) -> int:
        return self._eod

    def tok_encode(self, string: str, add_special_tokens=None, **kwargs) -> list[int]:
        return list(self._encode(string))

    def score(self, pairs: list[tuple[list[int], list[int]]]) -> list[tuple[float, bool]]:
        """(log p(continuation | context), whether it is the greedy one) per (context ids,
        continuation ids), answers in input order. The model reads each distinct input once,
        longest first in batches of ``batch_size``; an input that begins another is scored
        from the longer one's logits (``_readers``), as a causal model computes them for the
        shared positions: a multiple-choice question whose choices are single tokens (MMLU's
        " A" … " D") is one forward pass, not four."""
        out: list[tuple[float, bool] | None] = [None] * len(pairs)
        asks: dict[tuple[int, ...], list[tuple[int, list[int]]]] = {}
        for i, (ctx, cont) in enumerate(pairs):
            if not cont:
                raise ValueError(f"request {i}: empty continuation")
            if not ctx:
                raise ValueError(f"request {i}: empty context (give the eod token)")
            whole = (ctx + cont)[-(self.max_length + 1) :]
            scored = cont[-min(len(cont), len(whole) - 1) :]  # over max_length: its tail
            asks.setdefault(tuple(whole[:-1]), []).append((i, scored))
        readers = _readers(list(asks))
        inputs = sorted(readers, key=lambda ids: -len(ids))
        self.rows_read, self.requests = self.rows_read + len(inputs), self.requests + len(pairs)
        for b in range(0, len(inputs), self.batch_size):
            batch = inputs[b : b + self.batch_size]
            width = len(batch[0])
            tokens = torch.full((len(batch), width), self._eod, dtype=torch.long)
            for row, ids in enumerate(batch):
                tokens[row, : len(ids)] = torch.tensor(ids)
            with torch.no_grad():
                logp = torch.log_softmax(self._forward(tokens.to(self._device)).float(), dim=-1)
            for row, read in enumerate(batch):
                # causal: what follows a position (padding, a longer input) never reaches it
                for ids in readers[read]:
                    for i, cont in asks[ids]:
                        at = logp[row, len(ids) - len(cont) : len(ids)]
                        want = torch.tensor(cont, device=at.device)
                        total = at.gather(-1, want[:, None]).sum().item()
                        out[i] = (total, bool((at.argmax(-1) == want).all()))
        return out  # type: ignore[return-value]

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs):
        return self.score([(ctx, cont) for _, ctx, cont in requests])

    def rolling(self, tokens: list[int], prefix: int | None = None) -> float:
        """Log-likelihood of every token of ``tokens``, the first predicted from ``prefix``
        (default eod), in disjoint windows of ``max_length``."""
        first = self._eod if prefix is None else prefix
        windows = get_rolling_token_windows(tokens, first, self.max_length, context_len=1)
        pairs = [make_disjoint_window(w) for w in windows]
        return sum(s for s, _ in self.score(pairs))

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        return [self.rolling(self.tok_encode(req.args[0])) for req in requests]

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        raise NotImplementedError(
            "MegatronLM scores log-likelihoods only (multiple-choice and perplexity tasks); "
            "generation tasks are not supported here: export the checkpoint (tools/export_hf.py "
            "--load RUN --out FOLDER) and run them with lm-eval's own Hugging Face backend "
            "(lm_eval --model hf --model_args pretrained=FOLDER,trust_remote_code=True), whose "
            "generation the exported model serves with a key/value cache"
        )


def _readers(inputs: list[tuple[int, ...]]) -> dict[tuple[int, ...], list[tuple[int, ...]]]:
    """Each input the model reads → the inputs scored from its logits (itself and those that
    begin it). In lexicographic order an input that begins any other begins the one right
    after it, so one pass from the end hands every prefix to the longest input it begins."""
    order = sorted(inputs)
    reader: dict[tuple[int, ...], tuple[int, ...]] = {}
    for k in range(len(order) - 1, -1, -1):
        ids, nxt = order[k], order[k + 1] if k + 1 < len(order) else None
        reader[ids] = reader[nxt] if nxt is not None and nxt[: len(ids)] == ids else ids
    out: dict[tuple[int, ...], list[tuple[int, ...]]] = {}
    for ids in inputs:
        out.setdefault(reader[ids], []).append(ids)
    return out

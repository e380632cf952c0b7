"""Turn each sequence's last-token logits into its next token."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from pagefleet.worker.outputs import TokenLogprob
from pagefleet.worker.sampling_params import SamplingParams


def sample(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    generators: Sequence[torch.Generator | None],
) -> list[int | None]:
    """One token per row of `logits` ([num_rows, vocab]); None for a row that cannot be sampled.

    Greedy rows take the argmax (first index on ties, like HF). Other rows
    apply temperature, top-k and top-p, then draw with the row's own
    generator, on CPU in float32 so a seed gives the same token on any
    device and in any batch.

    A row whose logits hold NaN or +inf (or whose probabilities are not a
    distribution) gets None instead of raising: the caller fails that one
    request, and every other row of the batch still gets its token.
    """
    tokens: list[int | None] = [None] * len(params)
    ok = _finite_rows(logits)
    greedy = [i for i, p in enumerate(params) if p.greedy and ok[i]]
    if greedy:
        picked = logits[greedy].argmax(dim=-1).tolist()
        for i, tok in zip(greedy, picked, strict=True):
            tokens[i] = int(tok)
    for i, p in enumerate(params):
        if p.greedy or not ok[i]:
            continue
        row = logits[i].detach().to(device="cpu", dtype=torch.float32)
        probs = sampling_probs(row, p)
        if not (bool(torch.isfinite(probs).all()) and float(probs.sum()) > 0.0):
            continue
        tokens[i] = int(torch.multinomial(probs, 1, generator=generators[i]).item())
    return tokens


def _finite_rows(logits: torch.Tensor) -> list[bool]:
    """Per row: no NaN and no +inf (a -inf logit is a masked token, which is fine)."""
    bad = torch.isnan(logits) | torch.isposinf(logits)
    return (~bad.any(dim=-1)).tolist()


def sampling_probs(row: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Probabilities of one row after temperature, top-k and top-p filtering."""
    scaled = row / params.temperature
    if 0 < params.top_k < scaled.numel():
        kth = torch.topk(scaled, params.top_k).values[-1]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_logits, order = torch.sort(scaled, descending=True)
        sorted_probs = torch.softmax(sorted_logits, dim=-1)
        # Drop a token when the tokens strictly before it already reach top_p; the
        # most likely token always stays.
        mass_before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs
        drop_sorted = mass_before >= params.top_p
        drop_sorted[0] = False  # even when top_p rounds to 0 in float32
        drop = torch.zeros_like(drop_sorted).scatter(0, order, drop_sorted)
        scaled = scaled.masked_fill(drop, float("-inf"))
    return torch.softmax(scaled, dim=-1)


def token_logprobs(
    logits: torch.Tensor, tokens: Sequence[int], num_top: Sequence[int]
) -> list[TokenLogprob]:
    """Log-probabilities of the sampled `tokens`, from the same `logits` rows `sample` read.

    Row `i` gives `tokens[i]`'s log-probability under the model's distribution
    (log-softmax of the raw logits, before temperature and filtering, as vLLM
    reports by default) and the `num_top[i]` most likely tokens'.
    """
    if not tokens:
        return []
    logprobs = torch.log_softmax(logits.detach().to(device="cpu", dtype=torch.float32), dim=-1)
    chosen = logprobs.gather(1, torch.tensor(list(tokens)).unsqueeze(1)).squeeze(1).tolist()
    k = max(num_top)
    top_values, top_ids = torch.topk(logprobs, k, dim=-1) if k > 0 else (None, None)
    out = []
    for i, (token, logprob) in enumerate(zip(tokens, chosen, strict=True)):
        top: tuple[tuple[int, float], ...] = ()
        if top_values is not None and top_ids is not None and num_top[i] > 0:
            ids = top_ids[i, : num_top[i]].tolist()
            values = top_values[i, : num_top[i]].tolist()
            top = tuple(zip(ids, values, strict=True))
        out.append(TokenLogprob(int(token), float(logprob), top))
    return out

"""Turn each sequence's last-token logits into its next token."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from pagefleet.kernels.cpu_layers import fits_rows, layer_kernels
from pagefleet.kernels.transfer import host_to_device
from pagefleet.worker.outputs import TokenLogprob
from pagefleet.worker.sampling_params import SamplingParams


def sample(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    generators: Sequence[torch.Generator | None],
    histories: Sequence[TokenHistory] | None = None,
) -> list[int | None]:
    """One token per row of `logits` ([num_rows, vocab]); None for a row that cannot be sampled.

    First the rows' logit biases and penalties (`adjust_logits`, which
    needs `histories` when a row is penalized). Then greedy rows take the
    argmax (first index on ties, like HF). Other rows apply temperature,
    min-p, top-k and top-p, then draw with the row's own generator, on CPU
    in float32 so a seed gives the same token on any device and in any batch.

    A row whose logits hold NaN or +inf (or whose probabilities are not a
    distribution) gets None instead of raising: the caller fails that one
    request, and every other row of the batch still gets its token.

    On CUDA, an all-greedy batch without biases or penalties reads the device
    once (the argmax ids); rows that draw are copied to the host in one go.
    """
    tokens: list[int | None] = [None] * len(params)
    picked = greedy_picks(logits)
    ok = [index >= 0 for index in picked]
    adjusted = adjust_logits(logits, params, histories)
    greedy = [i for i, p in enumerate(params) if p.greedy and ok[i]]
    if greedy:
        if adjusted is logits:  # no bias or penalty anywhere: the argmax is already known
            greedy_tokens = [picked[i] for i in greedy]
        else:
            greedy_tokens = adjusted[greedy].argmax(dim=-1).tolist()
        for i, tok in zip(greedy, greedy_tokens, strict=True):
            tokens[i] = int(tok)
    drawn = [i for i, p in enumerate(params) if not p.greedy and ok[i]]
    if not drawn:
        return tokens
    host, host_rows = adjusted.detach(), drawn
    if host.device.type != "cpu":  # one device read for all drawn rows, not one per row
        host, host_rows = host[drawn].cpu(), list(range(len(drawn)))
    for i, k in zip(drawn, host_rows, strict=True):
        p = params[i]
        probs = sampling_probs(host[k].to(torch.float32), p)
        if not (bool(torch.isfinite(probs).all()) and float(probs.sum()) > 0.0):
            continue
        tokens[i] = int(torch.multinomial(probs, 1, generator=generators[i]).item())
    return tokens


def greedy_picks(logits: torch.Tensor) -> list[int]:
    """Each row's argmax (the first on ties), or -1 for a row that cannot be sampled (it
    holds a NaN or +inf), from one pass over the raw logits `[rows, vocab]`: in C for
    float32 rows on the CPU (`LayerKernels.greedy`, about 6x faster than torch's
    `max(dim=-1)` on SmolLM2's 49,152 columns), else torch's max, which propagates a NaN
    and says +inf, and its index."""
    if logits.dim() == 2 and fits_rows(logits):
        kernels = layer_kernels()
        if kernels is not None:
            return kernels.greedy(logits)
    return torch_greedy_picks(logits)


def torch_greedy_picks(logits: torch.Tensor) -> list[int]:
    """`greedy_picks` through torch: the max of each row (NaN when it holds a NaN, max
    propagates it; +inf when it holds +inf) and its index, the first on ties."""
    top, top_index = logits.max(dim=-1)
    picked: list[int] = torch.where(torch.isnan(top) | torch.isposinf(top), -1, top_index).tolist()
    return picked


@dataclass(frozen=True)
class TokenHistory:
    """What a row's penalties count: the prompt's token ids and those generated so far.

    A request resumed on another worker carries its earlier output at the end
    of its prompt; the engine puts those tokens back under `output`.
    """

    prompt: Sequence[int]
    output: Sequence[int]


def adjust_logits(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    histories: Sequence[TokenHistory] | None,
) -> torch.Tensor:
    """`logits` after each row's logit bias, then its repetition, frequency and presence
    penalties (in float32; the same tensor when no row sets any).

    Batched: one [rows, vocab] count of the output tokens and one mask of the
    prompt's, built with scatter from padded id tensors, and per-row penalty
    columns; a row with the neutral values is left unchanged.
    """
    biased = [i for i, p in enumerate(params) if p.logit_bias]
    penalized = [i for i, p in enumerate(params) if p.penalized]
    if not biased and not penalized:
        return logits
    out = logits.to(torch.float32)  # a copy unless it was float32 already
    if out is logits:
        out = logits.clone()
    device = out.device
    if biased:
        rows = [i for i in biased for _ in params[i].logit_bias]
        ids = [t for i in biased for t, _ in params[i].logit_bias]
        values = [b for i in biased for _, b in params[i].logit_bias]
        index = (host_to_device(torch.tensor(rows), device), host_to_device(torch.tensor(ids), device))
        out.index_put_(index, host_to_device(torch.tensor(values), device), accumulate=True)
    if penalized:
        if histories is None:
            raise ValueError("penalized rows need their token histories")
        sub = out[penalized]
        vocab = sub.shape[1]
        counts = _token_counts([histories[i].output for i in penalized], vocab, device)
        in_prompt = _token_counts([histories[i].prompt for i in penalized], vocab, device) > 0

        def column(name: str) -> torch.Tensor:
            values = [getattr(params[i], name) for i in penalized]
            return host_to_device(torch.tensor(values, dtype=torch.float32), device).unsqueeze(1)

        rep = column("repetition_penalty")
        seen = in_prompt | (counts > 0)
        sub = torch.where(seen, torch.where(sub > 0, sub / rep, sub * rep), sub)
        sub = sub - column("frequency_penalty") * counts
        sub = sub - column("presence_penalty") * (counts > 0).to(torch.float32)
        out[penalized] = sub
    return out


def _token_counts(id_lists: Sequence[Sequence[int]], vocab: int, device: torch.device) -> torch.Tensor:
    """[len(id_lists), vocab] float32: how many times each token occurs in each list."""
    width = max((len(ids) for ids in id_lists), default=0)
    # Padding points at an extra column, cut off at the end.
    padded = torch.full((len(id_lists), max(width, 1)), vocab, dtype=torch.long)
    for row, ids in enumerate(id_lists):
        if ids:
            padded[row, : len(ids)] = torch.as_tensor(list(ids), dtype=torch.long)
    padded = host_to_device(padded, device)
    counts = torch.zeros((len(id_lists), vocab + 1), dtype=torch.float32, device=device)
    counts.scatter_add_(1, padded, torch.ones_like(padded, dtype=torch.float32))
    return counts[:, :vocab]


def sampling_probs(row: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Probabilities of one row after temperature, min-p, top-k and top-p filtering."""
    scaled = row / params.temperature
    if params.min_p > 0.0:
        probs = torch.softmax(scaled, dim=-1)
        scaled = scaled.masked_fill(probs < params.min_p * probs.max(), float("-inf"))
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

"""How much of the reserved KV memory holds real tokens: paged blocks versus contiguous reservation.

    python benchmarks/kv_utilization.py            # full: 65,536-token pool, 5 trials
    python benchmarks/kv_utilization.py --smoke    # tiny pool, one trial, seconds

A fixed pool of KV token slots admits sequences, one after another from a
seeded stream, until the next one does not fit; each admitted sequence holds
its final length (prompt + output), the moment its memory need peaks. Schemes:

- paged, block size 8 / 16 / 32: the real `BlockPool` and `BlockTable`; a
  sequence holds ceil(len / block) blocks, so only its last block is partly empty;
- contiguous, max_model_len: every sequence reserves `max_model_len` slots up
  front (what a static KV cache without paging does; Orca "Max" in the vLLM paper);
- contiguous, power of two: every sequence reserves its length rounded up to a
  power of two (Orca "Pow2": the best a bucketing allocator can do).

Printed per scheme: concurrent sequences, reserved slots, slots holding real
tokens, their share (utilization) and the sequences relative to contiguous
max_model_len reservation. Targets (issue 2): paged at block 16 keeps >= 97%
of reserved slots filled (vLLM reports 96.3%; prior systems 20.4-38.2%), and
fits >= 2.5x the sequences of contiguous reservation.

Length mix: ShareGPT-like. Prompt and output lengths are drawn from lognormal
distributions whose means match ShareGPT as reported in the vLLM paper (SOSP'23,
Fig. 11: mean input 161 tokens, mean output 338 tokens); the lognormal shape and
its sigmas (prompt 1.0, output 0.8) are our assumption to give the heavy tail
of real chat logs. Lengths are clipped so prompt + output <= max_model_len (2048).
"""

from __future__ import annotations

import argparse
import math
import random
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from pagefleet.worker.block_pool import BlockPool, NoFreeBlocks
from pagefleet.worker.block_table import BlockTable

MAX_MODEL_LEN = 2048
PROMPT_MEAN, PROMPT_SIGMA = 161.0, 1.0
OUTPUT_MEAN, OUTPUT_SIGMA = 338.0, 0.8
TARGET_UTILIZATION = 0.97
TARGET_SEQ_RATIO = 2.5


def lognormal(rng: random.Random, mean: float, sigma: float) -> float:
    # For a lognormal, mean = exp(mu + sigma^2 / 2): solve for mu.
    return rng.lognormvariate(math.log(mean) - sigma * sigma / 2, sigma)


def sequence_lengths(seed: int, max_model_len: int = MAX_MODEL_LEN) -> Iterator[int]:
    """An endless seeded stream of ShareGPT-like sequence lengths (prompt + output)."""
    rng = random.Random(seed)
    while True:
        prompt = min(max(1, round(lognormal(rng, PROMPT_MEAN, PROMPT_SIGMA))), max_model_len - 1)
        output = min(
            max(1, round(lognormal(rng, OUTPUT_MEAN, OUTPUT_SIGMA))), max_model_len - prompt
        )
        yield prompt + output


@dataclass
class Fill:
    """Sequences admitted into one pool and the slots they reserved."""

    seqs: int = 0
    tokens: int = 0
    reserved: int = 0

    def add(self, other: Fill) -> None:
        self.seqs += other.seqs
        self.tokens += other.tokens
        self.reserved += other.reserved

    @property
    def utilization(self) -> float:
        return self.tokens / self.reserved if self.reserved else 0.0


def fill_paged(pool_tokens: int, block_size: int, seed: int) -> Fill:
    """Admit sequences into a real block pool until one does not fit."""
    pool = BlockPool(pool_tokens // block_size, block_size, enable_prefix_caching=False)
    tables: list[BlockTable] = []
    fill = Fill()
    for length in sequence_lengths(seed):
        table = BlockTable(pool)
        try:
            table.append_slots(length)
        except NoFreeBlocks:
            break
        tables.append(table)
        fill.seqs += 1
        fill.tokens += length
    fill.reserved = pool.stats().live * block_size
    for table in tables:
        table.free()
    pool.check_integrity()
    return fill


def fill_contiguous(pool_tokens: int, seed: int, reserve: str) -> Fill:
    """Admit sequences that each reserve a contiguous region until one does not fit."""
    fill = Fill()
    for length in sequence_lengths(seed):
        need = MAX_MODEL_LEN if reserve == "max" else 1 << (length - 1).bit_length()
        if fill.reserved + need > pool_tokens:
            break
        fill.seqs += 1
        fill.tokens += length
        fill.reserved += need
    return fill


def run(pool_tokens: int, trials: int) -> list[tuple[str, Fill]]:
    schemes: list[tuple[str, Fill]] = []
    for block_size in (8, 16, 32):
        total = Fill()
        for seed in range(trials):
            total.add(fill_paged(pool_tokens, block_size, seed))
        schemes.append((f"paged, block {block_size}", total))
    for reserve, name in (("max", "contiguous, max_model_len"), ("pow2", "contiguous, power of 2")):
        total = Fill()
        for seed in range(trials):
            total.add(fill_contiguous(pool_tokens, seed, reserve))
        schemes.append((name, total))
    return schemes


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="tiny pool, one trial")
    parser.add_argument("--pool-tokens", type=int, default=None, help="KV token slots in the pool")
    parser.add_argument("--trials", type=int, default=None, help="seeds averaged over")
    args = parser.parse_args(argv)
    pool_tokens = args.pool_tokens or (8192 if args.smoke else 65536)
    trials = args.trials or (1 if args.smoke else 5)

    mean = sum(x for x, _ in zip(sequence_lengths(12345), range(20000), strict=False)) / 20000
    print(
        f"pool {pool_tokens:,} token slots; {trials} trial(s); max_model_len {MAX_MODEL_LEN}; "
        f"ShareGPT-like lognormal lengths (prompt mean {PROMPT_MEAN:.0f} sigma {PROMPT_SIGMA}, "
        f"output mean {OUTPUT_MEAN:.0f} sigma {OUTPUT_SIGMA}; mean prompt+output {mean:.0f})"
    )
    schemes = run(pool_tokens, trials)
    contiguous = dict(schemes)["contiguous, max_model_len"]
    header = f"{'scheme':<28}{'seqs/trial':>11}{'reserved':>12}{'real tokens':>13}{'utilization':>13}{'seqs vs contig':>16}"
    print(header)
    print("-" * len(header))
    for name, fill in schemes:
        ratio = fill.seqs / contiguous.seqs if contiguous.seqs else float("inf")
        print(
            f"{name:<28}{fill.seqs / trials:>11.1f}{fill.reserved // trials:>12,}"
            f"{fill.tokens // trials:>13,}{fill.utilization:>12.1%}{ratio:>15.2f}x"
        )
    paged16 = dict(schemes)["paged, block 16"]
    seq_ratio = paged16.seqs / contiguous.seqs if contiguous.seqs else float("inf")
    util_ok = paged16.utilization >= TARGET_UTILIZATION
    ratio_ok = seq_ratio >= TARGET_SEQ_RATIO
    print()
    print(
        f"target: paged block 16 utilization >= {TARGET_UTILIZATION:.0%}: "
        f"{paged16.utilization:.1%} {'met' if util_ok else 'MISSED'}"
    )
    print(
        f"target: paged block 16 sequences >= {TARGET_SEQ_RATIO}x contiguous: "
        f"{seq_ratio:.2f}x {'met' if ratio_ok else 'MISSED'}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())

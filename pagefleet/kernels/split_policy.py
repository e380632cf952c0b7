"""When to split the KV of a sequence across programs (flash-decoding), as a pure function.

A single-pass program owns (sequence, query block, kv head) and walks the whole
context. With few sequences that leaves most multiprocessors idle while each
busy one streams a long context; splitting the context into chunks, each with
its own program, and reducing the partial results by log-sum-exp fills the
device. Splitting costs an extra write and read of fp32 partials, so it is
used only when the grid is smaller than the device and contexts are long.
"""

from __future__ import annotations

import os

SPLITS_ENV = "PAGEFLEET_KV_SPLITS"
MAX_SPLITS = 32
# Below this many context tokens per split the partial write/reduce costs more
# than the parallelism gains.
MIN_TOKENS_PER_SPLIT = 256
# Aim for this many programs per multiprocessor so that memory latency is hidden.
PROGRAMS_PER_SM = 2


def choose_num_splits(
    num_programs: int,
    max_context_len: int,
    num_sms: int,
    single_query_block: bool,
) -> int:
    """Number of KV splits for one call; 1 means the single-pass kernel.

    ``num_programs`` is the single-pass grid size (sequences x query blocks x kv
    heads); ``single_query_block`` is true when every sequence's queries fit one
    query block (decode, or a few speculative tokens): prefill chunks already
    give enough programs and keep the single pass. ``PAGEFLEET_KV_SPLITS=N``
    forces N (tests use it to run both paths on the same inputs).
    """
    forced = os.environ.get(SPLITS_ENV, "").strip()
    if forced:
        splits = int(forced)
        if not 1 <= splits <= MAX_SPLITS:
            raise ValueError(f"{SPLITS_ENV}={forced}: expected 1..{MAX_SPLITS}")
        return splits
    if not single_query_block or num_programs >= num_sms:
        return 1
    wanted = -(-PROGRAMS_PER_SM * num_sms // max(num_programs, 1))
    by_length = max_context_len // MIN_TOKENS_PER_SPLIT
    return max(1, min(wanted, by_length, MAX_SPLITS))

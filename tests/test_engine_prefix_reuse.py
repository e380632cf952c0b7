"""Prefix reuse the admission order makes possible: prompts sharing a prefix in one batch,
and a warm rerun of a workload larger than the pool."""

from __future__ import annotations

import torch

from pagefleet import LLM, SamplingParams
from pagefleet.worker.block_pool import BlockPool
from pagefleet.worker.prefix_hash import hash_token_blocks


def assert_pool_clean(llm: LLM) -> None:
    llm.check_integrity()
    stats = llm.stats()
    assert stats.live == 0 and stats.free + stats.cached == stats.total, stats


def random_ids(n: int, seed: int) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    return [int(t) for t in torch.randint(3, 1024, (n,), generator=gen)]


def test_prompts_sharing_a_prefix_in_one_generate_reuse_the_first_ones_blocks() -> None:
    shared = random_ids(512, seed=1)
    prompts = [shared + random_ids(20, seed=10 + i) for i in range(3)]
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    llm = LLM(model="tiny", num_kv_blocks=256, dtype="float64")
    outs = llm.generate(prompts, params)
    assert [o.num_cached_tokens for o in outs] == [0, 512, 512]
    assert_pool_clean(llm)
    alone = LLM(model="tiny", num_kv_blocks=256, dtype="float64", enable_prefix_caching=False)
    assert [o.token_ids for o in outs] == [o.token_ids for o in alone.generate(prompts, params)]
    assert len({t for o in outs for t in o.token_ids}) > 8  # diverse: equality means something


def test_warm_rerun_of_a_workload_larger_than_the_pool_hits_the_cache() -> None:
    # 8 prompts of 3 full blocks each, 16 blocks in the pool, 2 running at a time.
    prompts = [random_ids(49, seed=100 + i) for i in range(8)]
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    llm = LLM(model="tiny", num_kv_blocks=16, max_num_seqs=2)
    llm.generate(prompts, params)
    cold_hits = llm.stats().prefix_hit_tokens
    outs = llm.generate(prompts, params)
    warm_hits = llm.stats().prefix_hit_tokens - cold_hits
    assert cold_hits == 0
    # Plain LRU evicts each prompt's blocks just before it comes up again (0 hits).
    # Kept for the waiting requests instead: all the pool can keep while two
    # requests of 4 blocks run, 16 - 2 * 4 blocks.
    assert warm_hits == (16 - 2 * 4) * 16, [o.num_cached_tokens for o in outs]
    assert_pool_clean(llm)


def test_touch_makes_cached_blocks_the_last_to_be_evicted() -> None:
    pool = BlockPool(4, block_size=2)
    hashes = hash_token_blocks([1, 2, 3, 4, 5, 6], 2)
    blocks = pool.allocate(3)
    for b, h in zip(blocks, hashes, strict=True):
        pool.register(b, h)
    pool.free(blocks)  # cached in LRU order: blocks[0] is evicted first
    pool.touch([hashes[0]])
    pool.allocate(2)  # the free block, then the least recently used cached one
    assert not pool.is_cached(hashes[1])
    assert pool.is_cached(hashes[0]) and pool.is_cached(hashes[2])
    assert pool.stats().prefix_query_tokens == 0
    pool.check_integrity()

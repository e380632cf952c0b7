"""Engine behaviour on the built-in tiny model: validation, aborts, stops, n > 1, priorities."""

from __future__ import annotations

import pytest

from pagefleet import LLM, SamplingParams
from pagefleet.worker.engine import LLMEngine, RequestError
from pagefleet.worker.seeds import derive_seed


def assert_pool_clean(llm: LLM) -> None:
    llm.check_integrity()
    stats = llm.stats()
    assert stats.live == 0 and stats.free + stats.cached == stats.total, stats


@pytest.fixture(scope="module")
def llm() -> LLM:
    # 5 blocks of 16 tokens (80), 100-token context: small enough to hit every limit.
    return LLM(model="tiny", block_size=16, num_kv_blocks=5, max_model_len=100)


@pytest.fixture
def engine(llm: LLM) -> LLMEngine:
    yield llm.engine
    assert_pool_clean(llm)


PROMPT = "Once upon a time there was a small village by the sea."


@pytest.fixture(scope="module")
def greedy_reference(llm: LLM) -> list[int]:
    return llm.generate(PROMPT, SamplingParams(max_tokens=24, ignore_eos=True))[0].token_ids


# ------------------------------------------------------------------ validation


def test_prompt_plus_max_tokens_over_max_model_len_is_rejected(engine: LLMEngine) -> None:
    with pytest.raises(
        RequestError, match=r"10 tokens \+ max_tokens 91 = 101 exceeds max_model_len 100"
    ):
        engine.add_request("a", list(range(3, 13)), SamplingParams(max_tokens=91))


def test_request_that_cannot_fit_the_pool_alone_is_rejected(engine: LLMEngine) -> None:
    with pytest.raises(
        RequestError, match=r"needs 6 KV blocks of 16 tokens, but the pool has only 5"
    ):
        engine.add_request("a", list(range(3, 53)), SamplingParams(max_tokens=45))


def test_empty_prompt_is_rejected(engine: LLMEngine) -> None:
    with pytest.raises(RequestError, match="prompt is empty"):
        engine.add_request("a", [], SamplingParams())


def test_a_stop_token_id_outside_the_vocabulary_is_rejected_naming_its_size(engine: LLMEngine) -> None:
    vocab = engine.vocab_size
    with pytest.raises(RequestError, match=rf"stop_token_ids token id {vocab} is outside the vocabulary \[0, {vocab}\)"):
        engine.add_request("a", PROMPT, SamplingParams(stop_token_ids=(vocab,)))


@pytest.mark.parametrize("bad", [1024, -1])
def test_token_id_outside_the_vocabulary_is_rejected(engine: LLMEngine, bad: int) -> None:
    with pytest.raises(RequestError, match=rf"token id {bad} at position 1 .* \[0, 1024\)"):
        engine.add_request("a", [5, bad], SamplingParams())


def test_duplicate_request_id_is_rejected(engine: LLMEngine) -> None:
    engine.add_request("dup", [5, 6], SamplingParams(max_tokens=2))
    with pytest.raises(RequestError, match="'dup' is already in use"):
        engine.add_request("dup", [5, 6], SamplingParams())
    engine.abort_request("dup")
    engine.step()


def test_request_error_is_a_value_error() -> None:
    assert issubclass(RequestError, ValueError)


# ---------------------------------------------------------------------- aborts


def test_abort_mid_generation_frees_blocks_at_once(engine: LLMEngine) -> None:
    engine.add_request("keep", PROMPT, SamplingParams(max_tokens=30, ignore_eos=True))
    engine.add_request(
        "drop", PROMPT + " And more.", SamplingParams(max_tokens=30, ignore_eos=True)
    )
    for _ in range(4):
        engine.step()
    before = engine.stats()
    assert engine.abort_request("drop")
    assert engine.stats().live < before.live
    assert engine.stats().requests_aborted == before.requests_aborted + 1
    engine.check_integrity()
    outs = engine.step()
    aborted = [o for o in outs if o.request_id == "drop"]
    assert [o.finish_reason for o in aborted] == ["abort"]
    while engine.has_unfinished_requests():
        outs = engine.step()
    assert outs[-1].request_id == "keep" and outs[-1].finish_reason == "length"


def test_abort_of_a_waiting_request_and_of_an_unknown_id(engine: LLMEngine) -> None:
    engine.add_request("w", PROMPT, SamplingParams())
    assert engine.abort_request("w")
    assert not engine.abort_request("w")
    assert not engine.abort_request("never-seen")
    aborted = engine.stats().requests_aborted
    assert not engine.abort_request("w")  # an unknown or finished id is not counted
    assert engine.stats().requests_aborted == aborted
    assert [o.finish_reason for o in engine.step()] == ["abort"]
    assert not engine.has_unfinished_requests()


# ----------------------------------------------------------------------- stops


def test_stop_token_id_ends_generation_and_is_kept(llm: LLM, greedy_reference: list[int]) -> None:
    stop = greedy_reference[6]
    first = greedy_reference.index(stop)
    out = llm.generate(PROMPT, SamplingParams(max_tokens=24, stop_token_ids=(stop,)))[0]
    assert out.token_ids == greedy_reference[: first + 1]
    assert out.finish_reason == "stop"
    assert_pool_clean(llm)


def test_eos_stops_unless_ignore_eos(llm: LLM, greedy_reference: list[int]) -> None:
    eos = greedy_reference[5]
    first = greedy_reference.index(eos)
    llm.engine.eos_token_ids.add(eos)
    try:
        stopped = llm.generate(PROMPT, SamplingParams(max_tokens=24))[0]
        ignored = llm.generate(PROMPT, SamplingParams(max_tokens=24, ignore_eos=True))[0]
    finally:
        llm.engine.eos_token_ids.discard(eos)
    assert stopped.token_ids == greedy_reference[: first + 1] and stopped.finish_reason == "stop"
    assert ignored.token_ids == greedy_reference and ignored.finish_reason == "length"


def test_stop_string_is_excluded_and_streamed_text_matches(
    engine: LLMEngine, greedy_reference: list[int]
) -> None:
    full = engine.tokenizer.decode(greedy_reference, skip_special_tokens=True)
    stop = full[len(full) // 2 : len(full) // 2 + 3]
    engine.add_request("s", PROMPT, SamplingParams(max_tokens=24, stop=(stop,), ignore_eos=True))
    streamed = ""
    while engine.has_unfinished_requests():
        for out in engine.step():
            streamed += out.new_text
            final = out
    assert final.finish_reason == "stop"
    assert final.text == full[: full.index(stop)]
    assert streamed == final.text


# ---------------------------------------------------------------------- n > 1


def test_parallel_greedy_completions_share_blocks_copy_on_write(
    llm: LLM, greedy_reference: list[int]
) -> None:
    cow_before = llm.stats().cow_copies
    out = llm.generate(PROMPT, SamplingParams(max_tokens=24, n=3, ignore_eos=True))[0]
    # The prompt's last block is partly filled: each fork's first write copies it.
    assert llm.stats().cow_copies > cow_before
    assert [c.token_ids for c in out.outputs] == [greedy_reference] * 3
    assert_pool_clean(llm)


def test_seeded_parallel_sampling_is_reproducible_in_any_batch(llm: LLM) -> None:
    params = SamplingParams(max_tokens=12, n=3, temperature=1.0, seed=42, ignore_eos=True)
    alone = llm.generate(PROMPT, params)[0]
    batched = llm.generate(
        ["Another prompt entirely.", PROMPT, "A third one"],
        [SamplingParams(max_tokens=5, temperature=1.0), params, SamplingParams(max_tokens=9)],
    )[1]
    assert [c.token_ids for c in batched.outputs] == [c.token_ids for c in alone.outputs]
    assert len({tuple(c.token_ids) for c in alone.outputs}) > 1  # the n draws differ
    assert_pool_clean(llm)


@pytest.mark.parametrize(("n", "index"), [(1, 0), (3, 2)])
def test_a_seeded_completion_resumed_on_another_engine_draws_the_undisturbed_tokens(
    llm: LLM, n: int, index: int
) -> None:
    params = SamplingParams(max_tokens=12, n=n, temperature=1.0, seed=42, ignore_eos=True)
    whole = llm.generate(PROMPT, params)[0].outputs[index].token_ids
    other = LLM(model="tiny", block_size=16, num_kv_blocks=5, max_model_len=100).engine
    # As the ingress resumes one completion after a failover: its tokens so far end the
    # prompt, and it draws from the seed the engine gave that completion.
    rest = SamplingParams(max_tokens=7, temperature=1.0, seed=derive_seed(42, index), ignore_eos=True)
    prompt = [int(t) for t in llm.tokenizer.encode(PROMPT)]
    other.add_request("resumed", prompt + whole[:5], rest, num_resumed_tokens=5)
    resumed: list[int] = []
    while other.has_unfinished_requests():
        resumed += [t for o in other.step() for t in o.new_token_ids]
    assert whole[:5] + resumed == whole


def test_a_seeded_sampled_request_preempted_by_recompute_draws_the_undisturbed_tokens() -> None:
    llm = LLM(model="tiny", block_size=16, num_kv_blocks=4, enable_prefix_caching=False)
    seeded = SamplingParams(max_tokens=40, temperature=1.0, seed=7, ignore_eos=True)
    undisturbed = llm.generate(list(range(3, 23)), seeded)[0].token_ids
    engine = llm.engine
    engine.add_request("low", list(range(3, 23)), seeded, priority=0)
    engine.step()
    engine.add_request("high", list(range(30, 50)), SamplingParams(max_tokens=40, ignore_eos=True), priority=5)
    done: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        done.update({o.request_id: o.token_ids for o in engine.step() if o.finished})
    assert engine.stats().preemptions_recompute > 0
    assert done["low"] == undisturbed
    assert_pool_clean(llm)


# ------------------------------------------------------------------ scheduling


def test_long_prompt_is_prefilled_in_chunks_of_the_token_budget() -> None:
    engine = LLM(model="tiny", max_num_batched_tokens=8).engine
    engine.add_request("c", list(range(3, 43)), SamplingParams(max_tokens=2))  # 40 tokens
    steps_until_first_token = 0
    while True:
        steps_until_first_token += 1
        if any(o.new_token_ids for o in engine.step()):
            break
    assert steps_until_first_token == 5  # 40 / 8


def test_lower_priority_is_preempted_even_when_admitted_first() -> None:
    llm = LLM(model="tiny", block_size=16, num_kv_blocks=4, enable_prefix_caching=False)
    engine = llm.engine
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    engine.add_request("low", list(range(3, 23)), params, priority=0)
    engine.step()
    engine.add_request("high", list(range(30, 50)), params, priority=5)
    finished: list[str] = []
    while engine.has_unfinished_requests():
        finished += [o.request_id for o in engine.step() if o.finished]
    assert engine.stats().preemptions_total > 0
    assert finished == ["high", "low"]
    assert_pool_clean(llm)


def test_swap_falls_back_to_recompute_when_swap_space_is_full() -> None:
    llm = LLM(model="tiny", num_kv_blocks=4, preemption_mode="swap", swap_space_bytes=1)
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    llm.generate([list(range(3, 23)), list(range(30, 50))], params)
    stats = llm.stats()
    assert stats.preemptions_recompute > 0 and stats.swaps_out == 0, stats
    assert_pool_clean(llm)


def test_prefix_cache_same_salt_hits_and_other_salt_misses(engine: LLMEngine) -> None:
    prompt = list(range(3, 40))  # two full blocks of 16 before the last token
    params = SamplingParams(max_tokens=1)
    cached: dict[str, int] = {}
    for request_id, salt in [("t1", "tenant-a"), ("t2", "tenant-a"), ("t3", "tenant-b")]:
        engine.add_request(request_id, prompt, params, salt=salt)
        while engine.has_unfinished_requests():
            for out in engine.step():
                cached[out.request_id] = out.num_cached_tokens
    assert cached == {"t1": 0, "t2": 32, "t3": 0}


def test_live_blocks_are_counted_per_tenant_salt(engine: LLMEngine) -> None:
    params = SamplingParams(max_tokens=20, ignore_eos=True)
    engine.add_request("a", list(range(3, 40)), params, salt="tenant-a")
    engine.add_request("b", list(range(50, 60)), params, salt="tenant-b")
    engine.add_request("open", list(range(70, 75)), params)
    engine.step()
    per_tenant = engine.tenant_live_blocks()
    # 37 prompt tokens + 1 = 3 blocks of 16; 10 + 1 and 5 + 1 tokens: one block each.
    assert per_tenant == {"tenant-a": 3, "tenant-b": 1, "": 1}
    assert sum(per_tenant.values()) == engine.stats().live
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.tenant_live_blocks() == {}
    engine.check_integrity()


def test_evict_cached_frees_lru_cached_blocks_with_removed_events(engine: LLMEngine) -> None:
    engine.add_request("fill-cache", list(range(3, 40)), SamplingParams(max_tokens=1))
    while engine.has_unfinished_requests():
        engine.step()
    engine.drain_kv_events()
    before = engine.stats()
    assert before.cached >= 2
    assert engine.evict_cached(1) == 1
    after = engine.stats()
    assert (after.cached, after.free) == (before.cached - 1, before.free + 1)
    assert after.evictions == before.evictions + 1
    assert [kind for kind, _ in engine.drain_kv_events()] == ["removed"]
    assert engine.evict_cached(10**6) == before.cached - 1  # never more than there are
    assert engine.stats().cached == 0


def test_evict_cached_rejects_a_negative_count(engine: LLMEngine) -> None:
    with pytest.raises(ValueError, match=">= 0"):
        engine.evict_cached(-1)


def run_low_then_high(llm: LLM, priority: int, max_num_seqs_full: bool = False) -> dict[str, list[int]]:
    """A 40-token low-priority request fills the pool (or the seq slots); then `high` arrives.

    Returns each request's tokens, keyed in finishing order.
    """
    engine = llm.engine
    engine.add_request("low", list(range(3, 43)), SamplingParams(max_tokens=20, ignore_eos=True))
    engine.step()  # low holds 3 of the 4 blocks (one slot of one, with max_num_seqs=1)
    engine.add_request(
        "high", list(range(50, 70)), SamplingParams(max_tokens=8, ignore_eos=True), priority=priority
    )
    done: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        done.update({o.request_id: o.token_ids for o in engine.step() if o.finished})
    return done


def alone(llm: LLM, prompt: list[int], max_tokens: int) -> list[int]:
    return llm.generate(prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True))[0].token_ids


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_waiting_higher_priority_preempts_a_running_lower_one_for_blocks(mode: str) -> None:
    llm = LLM(model="tiny", block_size=16, num_kv_blocks=4, preemption_mode=mode)
    done = run_low_then_high(llm, priority=5)
    assert list(done) == ["high", "low"]
    stats = llm.stats()
    assert getattr(stats, f"preemptions_{mode}") >= 1, stats
    # Preempted or not, greedy output is the output each request has alone.
    assert done["low"] == alone(llm, list(range(3, 43)), 20)
    assert done["high"] == alone(llm, list(range(50, 70)), 8)
    assert_pool_clean(llm)


def test_waiting_higher_priority_preempts_for_a_sequence_slot() -> None:
    llm = LLM(model="tiny", block_size=16, num_kv_blocks=16, max_num_seqs=1)
    done = run_low_then_high(llm, priority=5)
    assert list(done) == ["high", "low"]
    assert llm.stats().preemptions_total >= 1
    assert done["low"] == alone(llm, list(range(3, 43)), 20)
    assert_pool_clean(llm)


def test_equal_priority_waits_instead_of_preempting() -> None:
    llm = LLM(model="tiny", block_size=16, num_kv_blocks=4)
    done = run_low_then_high(llm, priority=0)
    assert list(done) == ["low", "high"]
    assert llm.stats().preemptions_total == 0
    assert_pool_clean(llm)


def test_no_preemption_when_the_lower_ones_cannot_make_room() -> None:
    # high needs all 4 blocks' worth of prompt but low frees only its own 3 while a
    # priority-9 request keeps the 4th: preempting low would seat nobody.
    llm = LLM(model="tiny", block_size=16, num_kv_blocks=5, enable_prefix_caching=False)
    engine = llm.engine
    engine.add_request("top", list(range(3, 10)), SamplingParams(max_tokens=8, ignore_eos=True), priority=9)
    engine.add_request("low", list(range(10, 50)), SamplingParams(max_tokens=8, ignore_eos=True))
    engine.step()  # top 1 block, low 3 blocks, 1 free
    engine.add_request("big", list(range(3, 83)), SamplingParams(max_tokens=1), priority=5)  # 5 blocks
    engine.step()
    assert llm.stats().preemptions_total == 0
    while engine.has_unfinished_requests():
        engine.step()
    assert_pool_clean(llm)


def test_block_claims_count_what_requests_hold_at_max_tokens() -> None:
    llm = LLM(model="tiny", block_size=16, num_kv_blocks=16)
    engine = llm.engine
    # 20 + 40 tokens, the last never written: 59 tokens in 4 blocks; 2 held after prefill.
    engine.add_request("a@r1", list(range(3, 23)), SamplingParams(max_tokens=40, ignore_eos=True))
    # Two completions of 10 + 30: 1 shared prompt block... none full (10 < 16), so 3 each.
    engine.add_request(
        "b@r2", list(range(30, 40)), SamplingParams(max_tokens=30, n=2, ignore_eos=True), priority=2
    )
    claims = engine.block_claims()
    assert claims.by_request == {"a@r1": 4, "b@r2": 6}
    assert claims.by_priority == {0: (1, 4), 2: (1, 6)}
    assert claims.committed == 10  # nothing held yet
    engine.step()
    assert engine.block_claims().committed == 10 - engine.stats().live
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.block_claims().committed == 0
    assert_pool_clean(llm)

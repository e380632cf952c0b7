"""Per-tenant caps on live KV blocks (`tenant_max_live_blocks`) in one engine, tiny model.

Blocks of 4 tokens; tenant "capped" may hold 8 live blocks, tenant "free"
has no cap. Every test ends with a clean pool (free + cached == total).
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from pagefleet import LLM, SamplingParams
from pagefleet.worker.engine import LLMEngine, RequestError
from pagefleet.worker.sequence import SequenceStatus

CAP = 8
BLOCK = 4


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(
        model="tiny",
        block_size=BLOCK,
        num_kv_blocks=64,
        max_model_len=64,
        tenant_max_live_blocks=(("capped", CAP),),
    )


@pytest.fixture
def engine(llm: LLM) -> Iterator[LLMEngine]:
    llm.engine.kv.evict()
    yield llm.engine
    llm.check_integrity()
    stats = llm.stats()
    assert stats.live == 0 and stats.free + stats.cached == stats.total, stats


def _prompt(i: int, length: int = 12) -> list[int]:
    return [(7 * i + j) % 200 + 3 for j in range(length)]


def _status(engine: LLMEngine, request_id: str) -> SequenceStatus:
    return engine.requests[request_id].sequences[0].status


def _run_to_end(engine: LLMEngine) -> dict[str, list[int]]:
    tokens: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens[out.request_id] = out.token_ids
        assert engine.tenant_live_blocks().get("capped", 0) <= CAP
    return tokens


def test_a_tenant_at_its_cap_waits_while_another_tenant_behind_it_runs(engine: LLMEngine) -> None:
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    # 20 prompt tokens: 5 blocks each, so the second capped request would pass 8 at once.
    engine.add_request("c1", _prompt(1, 20), params, salt="capped")
    engine.add_request("c2", _prompt(2, 20), params, salt="capped")
    engine.add_request("f1", _prompt(3, 20), params, salt="free")
    engine.step()
    assert _status(engine, "c1") is SequenceStatus.RUNNING
    assert _status(engine, "c2") is SequenceStatus.WAITING
    assert _status(engine, "f1") is SequenceStatus.RUNNING
    assert engine.tenant_cap_refusals()["capped"] >= 1
    _run_to_end(engine)


def test_a_capped_tenant_never_holds_more_than_its_cap_and_its_output_is_unchanged(
    engine: LLMEngine, llm: LLM
) -> None:
    params = SamplingParams(max_tokens=16, ignore_eos=True)
    reference = LLM(model="tiny", block_size=BLOCK, num_kv_blocks=64, max_model_len=64)
    want = [out.token_ids for out in reference.generate([_prompt(i, 6) for i in range(4)], params)]
    for i in range(4):
        engine.add_request(f"c{i}", _prompt(i, 6), params, salt="capped")
    got = _run_to_end(engine)  # asserts the cap after every step
    assert [got[f"c{i}"] for i in range(4)] == want


def test_past_its_cap_a_tenant_preempts_its_own_sequence_not_another_tenant_s(
    engine: LLMEngine,
) -> None:
    params = SamplingParams(max_tokens=20, ignore_eos=True)
    # Two capped requests of 2 blocks each fit at admission, then grow to 6 blocks each.
    engine.add_request("c1", _prompt(1, 4), params, salt="capped")
    engine.add_request("c2", _prompt(2, 4), params, salt="capped")
    engine.add_request("f1", _prompt(3, 4), params, salt="free")
    before = engine.stats().preemptions_total
    computed_free = 0
    while engine.has_unfinished_requests():
        engine.step()
        if "f1" in engine.requests:
            seq = engine.requests["f1"].sequences[0]
            assert seq.status is SequenceStatus.RUNNING, "the uncapped tenant was preempted"
            assert seq.num_computed_tokens >= computed_free
            computed_free = seq.num_computed_tokens
    assert engine.stats().preemptions_total > before
    assert engine.tenant_cap_refusals()["capped"] >= 1


def test_a_request_larger_than_its_tenant_s_cap_is_refused_naming_the_cap(
    engine: LLMEngine,
) -> None:
    with pytest.raises(RequestError, match=f"the tenant's max_live_blocks is {CAP}"):
        engine.add_request("big", _prompt(1, 30), SamplingParams(max_tokens=8), salt="capped")
    # Without the cap the same request is fine.
    engine.add_request("big", _prompt(1, 30), SamplingParams(max_tokens=8), salt="free")
    _run_to_end(engine)


def test_a_cap_below_one_block_is_a_config_error() -> None:
    from pagefleet.worker.config import EngineConfig

    with pytest.raises(ValueError, match="tenant_max_live_blocks for salt 'x' must be >= 1"):
        EngineConfig(tenant_max_live_blocks=(("x", 0),))

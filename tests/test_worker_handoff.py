"""The worker's side of migration and of aborts from any ingress replica, without a cluster.

A hand-off by KV transfer goes through the object store of an in-process Ray.

A `WorkerActor` is a plain class: here it runs in-process around a tiny engine
(no report loop), so the tests drive its streams directly.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import AsyncIterator, Iterator

import pytest
import ray

from pagefleet import LLM, SamplingParams
from pagefleet.cluster.app import start_local_ray, stop_local_ray
from pagefleet.worker import model_files
from pagefleet.worker.actor import WorkerActor
from pagefleet.worker.config import EngineConfig
from pagefleet.worker.engine import LLMEngine
from pagefleet.worker.events import LoadReport
from pagefleet.worker.wire import KVHandoff, TokenDelta, WorkerRequest

BLOCK_SIZE = 4
LONG = SamplingParams(max_tokens=100, ignore_eos=True)


@pytest.fixture(scope="module")
def offline() -> LLM:
    return LLM(model="tiny", block_size=BLOCK_SIZE, num_kv_blocks=64)


def _actor() -> WorkerActor:
    config = EngineConfig(model="tiny", block_size=BLOCK_SIZE, num_kv_blocks=64)
    return WorkerActor("w0", "default", config, report_interval_s=0)


def _ids(text: str) -> tuple[int, ...]:
    """The tiny model's token ids of `text`: the ingress sends workers token ids only."""
    tokenizer = model_files.load_tokenizer(model_files.resolve_model_path("tiny"))
    return tuple(int(t) for t in tokenizer.encode(text))


def _request(request_id: str, prompt: str) -> WorkerRequest:
    return WorkerRequest(request_id, _ids(prompt), LONG)


async def _take(stream: AsyncIterator[TokenDelta], n_tokens: int) -> list[TokenDelta]:
    """Deltas until at least `n_tokens` tokens came."""
    got: list[TokenDelta] = []
    while sum(len(d.token_ids) for d in got) < n_tokens:
        got.append(await anext(stream))
    return got


async def _settled(actor: WorkerActor) -> dict[str, int]:
    """The engine's counters once nothing is live (aborts apply between two steps)."""
    for _ in range(500):
        stats = await actor.stats()
        if stats.live == 0 and stats.num_running == 0:
            return stats
        await asyncio.sleep(0.01)
    raise AssertionError(f"blocks still live: {stats}")



async def _report(actor: WorkerActor) -> LoadReport:
    """The load report the actor's next push to the scheduler would carry."""
    report, _, _ = await actor._next_report(snapshot=False)
    return report

def test_a_handed_off_request_ends_its_stream_naming_the_target_and_frees_its_blocks(
    offline: LLM,
) -> None:
    prompt = "This request moves to another worker halfway"
    want = offline.generate(prompt, LONG)[0].token_ids

    async def main() -> tuple[list[TokenDelta], dict[str, int]]:
        actor = _actor()
        stream = actor.generate(_request("k@r1", prompt))
        got = await _take(stream, 5)
        actor._migrate("k@r1", "w1", transfer=False)
        got += [d async for d in stream]
        return got, await _settled(actor)

    got, stats = asyncio.run(main())
    last = got[-1]
    assert last.migrated_to == "w1" and last.finish_reason is None and last.error is None
    assert all(d.migrated_to is None and d.finish_reason is None for d in got[:-1])
    streamed = [t for d in got for t in d.token_ids]
    assert 5 <= len(streamed) < len(want) and streamed == want[: len(streamed)]
    assert stats.free + stats.cached == stats.total


def test_abort_by_key_ends_the_request_of_that_key_whichever_replica_sent_it() -> None:
    async def main() -> tuple[bool, bool, list[TokenDelta], list[TokenDelta], dict[str, int]]:
        actor = _actor()
        # Two tenants' requests with the same client id "x", sent by two replicas.
        mine = actor.generate(_request("1:a:x@replica-1", "Tenant a streams this"))
        theirs = actor.generate(_request("1:b:x@replica-2", "Tenant b streams this"))
        await _take(mine, 1)
        await _take(theirs, 1)
        unknown = await actor.abort_key("1:c:x")
        found = await actor.abort_key("1:a:x")
        rest_mine = [d async for d in mine]
        more_theirs = await _take(theirs, 3)
        await theirs.aclose()  # the client leaves: aborted too
        return unknown, found, rest_mine, more_theirs, await _settled(actor)

    unknown, found, rest_mine, more_theirs, stats = asyncio.run(main())
    assert not unknown and found
    assert rest_mine[-1].finish_reason == "abort"
    assert all(d.finish_reason is None for d in more_theirs)  # the other tenant's runs on
    assert stats.free + stats.cached == stats.total


@pytest.fixture(scope="module")
def small_engine() -> Iterator[LLMEngine]:
    yield LLMEngine(EngineConfig(model="tiny", block_size=BLOCK_SIZE, num_kv_blocks=16))


def test_an_engine_short_of_blocks_says_so_and_lists_its_requests_latest_admitted_last(
    small_engine: LLMEngine,
) -> None:
    engine = small_engine
    for i in range(2):  # 3 prompt blocks each, growing to 12
        engine.add_request(f"r{i}", f"Two run {i}", SamplingParams(max_tokens=36, ignore_eos=True))
    while min(len(s.token_ids) for r in engine.requests.values() for s in r.sequences) < 24:
        engine.step()
    assert engine.scheduler.preemptions["recompute"] == 0 and engine.blocks_short() == 0
    # 12 of 16 blocks live: a 6-block prompt cannot be admitted.
    engine.add_request("r2", list(range(10, 34)), SamplingParams(max_tokens=4, ignore_eos=True))
    engine.step()
    assert engine.blocks_short() >= 2
    loads = {r.request_id: r for r in engine.request_loads()}
    assert set(loads) == {"r0", "r1", "r2"}
    assert loads["r2"].admitted_seq > max(loads["r0"].admitted_seq, loads["r1"].admitted_seq)
    assert loads["r2"].num_tokens == 24 and loads["r0"].num_tokens >= 25
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.blocks_short() == 0 and engine.request_loads() == []
    stats = engine.stats()
    assert stats.free + stats.cached == stats.total


def test_the_worker_report_carries_the_shortage_after_a_preemption() -> None:
    async def main() -> LoadReport:
        actor = WorkerActor(
            "w0", "default",
            EngineConfig(model="tiny", block_size=BLOCK_SIZE, num_kv_blocks=16),
            report_interval_s=0,
        )
        params = SamplingParams(max_tokens=48, ignore_eos=True)
        streams = [
            actor.generate(WorkerRequest(f"r{i}@r1", _ids(f"Two run {i}"), params)) for i in range(2)
        ]
        await asyncio.gather(*(_take(s, 1) for s in streams))
        # The streams buffer; the engine runs on until one of them is preempted.
        while (await actor.stats()).preemptions_total == 0:
            await asyncio.sleep(0.002)
        report = await _report(actor)
        for s in streams:
            await s.aclose()
        await _settled(actor)
        return report

    report = asyncio.run(main())
    assert report.blocks_short >= 1
    # The victim (admitted last) is still running or waiting; the other may be done.
    assert "r1@r1" in {r.request_id for r in report.requests} <= {"r0@r1", "r1@r1"}


def test_preemptions_that_keep_a_tenant_within_its_cap_do_not_mark_the_engine_short() -> None:
    engine = LLMEngine(
        EngineConfig(
            model="tiny", block_size=BLOCK_SIZE, num_kv_blocks=64,
            tenant_max_live_blocks=(("capped", 8),),
        )
    )
    params = SamplingParams(max_tokens=24, ignore_eos=True)  # up to 7 blocks each
    for i in range(2):
        engine.add_request(f"c{i}", f"Capped {i}", params, salt="capped")
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.scheduler.preemptions["recompute"] > 0  # the cap preempted
    assert engine.scheduler.block_preemptions == 0  # the pool never ran short


# ----- migration by KV transfer (the object store of a local Ray) ---------------------

CONTEXT = [5 + (11 * i) % 300 for i in range(30)]  # 7 full blocks of 4 and a partial one


@pytest.fixture(scope="module")
def local_ray() -> Iterator[None]:
    """An in-process Ray for `ray.put` / fetching a hand-off (no cluster, no actors)."""
    if ray.is_initialized():
        yield
        return
    start_local_ray(num_cpus=1, logging_level="ERROR")
    try:
        yield
    finally:
        stop_local_ray()  # SIGKILL: Ray's own stop waits on processes that ignore SIGTERM


async def _handed_off(source: WorkerActor, n_tokens: int) -> list[TokenDelta]:
    """Stream CONTEXT on `source`, hand it off by transfer after `n_tokens` tokens."""
    stream = source.generate(WorkerRequest("k@r1", tuple(CONTEXT), LONG, salt="t"))
    got = await _take(stream, n_tokens)
    source._migrate("k@r1", "w1", transfer=True)
    return got + [d async for d in stream]


async def _resume(target: WorkerActor, got: list[TokenDelta], kv: KVHandoff | None) -> list[TokenDelta]:
    """What the ingress does on a hand-off: prompt + streamed tokens to the target."""
    streamed = [t for d in got for t in d.token_ids]
    params = SamplingParams(max_tokens=LONG.max_tokens - len(streamed), ignore_eos=True)
    request = WorkerRequest("k@r1", (*CONTEXT, *streamed), params, salt="t", kv=kv)
    return [d async for d in target.generate(request)]


def test_a_hand_off_by_transfer_carries_the_blocks_and_the_target_computes_only_the_tail(
    offline: LLM, local_ray: None
) -> None:
    want = offline.generate(CONTEXT, LONG)[0].token_ids

    async def main() -> tuple[list[TokenDelta], list[TokenDelta], dict[str, int], dict[str, int],
                              LoadReport, LoadReport]:
        source, target = _actor(), _actor()
        before = await _report(target)
        got = await _handed_off(source, 5)
        rest = await _resume(target, got, got[-1].kv)
        after = await _report(target)
        return got, rest, await _settled(source), await _settled(target), before, after

    got, rest, source_stats, target_stats, before, after = asyncio.run(main())
    # The target reports what the import cost it, and what recomputing would (the
    # scheduler's "auto" choice weighs one against the other).
    assert before.kv_import_s_per_block == 0.0 and after.kv_import_s_per_block > 0
    assert after.recompute_s_per_token > 0
    kv = got[-1].kv
    assert got[-1].migrated_to == "w1" and kv is not None
    context = len(CONTEXT) + sum(len(d.token_ids) for d in got)
    assert len(kv.block_hashes) == (context - 1) // BLOCK_SIZE  # every full, written block
    assert [t for d in got + rest for t in d.token_ids] == want
    assert rest[-1].finish_reason == "length"
    assert rest[0].cached_tokens == len(kv.block_hashes) * BLOCK_SIZE  # only the tail computed
    assert source_stats.kv_blocks_exported == target_stats.kv_blocks_imported == len(kv.block_hashes)
    assert target_stats.kv_import_failures == 0
    for stats in (source_stats, target_stats):
        assert stats.free + stats.cached == stats.total


def test_a_hand_off_whose_blocks_cannot_be_fetched_is_recomputed_with_the_same_output(
    offline: LLM, local_ray: None
) -> None:
    want = offline.generate(CONTEXT, LONG)[0].token_ids

    def lost() -> None:  # local, so Ray ships it by value (the tests are no package on workers)
        raise RuntimeError("the object's node is gone")

    async def main() -> tuple[list[TokenDelta], list[TokenDelta], dict[str, int]]:
        source, target = _actor(), _actor()
        got = await _handed_off(source, 5)
        kv = got[-1].kv
        assert kv is not None
        # A hand-off whose object cannot be fetched: getting it raises.
        failed = ray.remote(lost).options(num_cpus=0).remote()
        rest = await _resume(target, got, dataclasses.replace(kv, blocks=failed))
        await _settled(source)
        await target.check_integrity()
        return got, rest, await _settled(target)

    got, rest, stats = asyncio.run(main())
    assert [t for d in got + rest for t in d.token_ids] == want
    assert rest[0].cached_tokens == 0  # recomputed
    assert stats.kv_import_failures == 1 and stats.kv_blocks_imported == 0
    assert stats.free + stats.cached == stats.total


def test_an_abort_while_the_blocks_are_fetched_ends_the_request_before_it_runs(
    local_ray: None,
) -> None:
    def slow() -> None:  # local, so Ray ships it by value
        time.sleep(30)

    async def main() -> tuple[list[TokenDelta], dict[str, int]]:
        target = _actor()
        kv = KVHandoff((b"\0" * 32,), ray.remote(slow).options(num_cpus=0).remote(), (1,), "float32")
        stream = target.generate(WorkerRequest("k@r1", tuple(CONTEXT), LONG, salt="t", kv=kv))
        first = asyncio.ensure_future(anext(stream))
        await asyncio.sleep(0.5)  # it waits for the object
        assert not first.done()
        await target.abort("k@r1")
        got = [await first] + [d async for d in stream]
        return got, await _settled(target)

    got, stats = asyncio.run(main())
    assert [d.finish_reason for d in got] == ["abort"] and not got[0].token_ids
    assert stats.num_waiting == 0 and stats.free == stats.total

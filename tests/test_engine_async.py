"""AsyncEngine: concurrent streams, cancellation, errors."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest

from pagefleet.worker.async_engine import AsyncEngine
from pagefleet.worker.config import EngineConfig
from pagefleet.worker.engine import RequestError
from pagefleet.worker.outputs import RequestOutput
from pagefleet.worker.sampling_params import SamplingParams

PARAMS = SamplingParams(max_tokens=12, ignore_eos=True)
PROMPTS = ["First prompt", "Second, longer prompt about ships", "Third", "Fourth one here"]


@pytest.fixture(scope="module")
def engine() -> Iterator[AsyncEngine]:
    eng = AsyncEngine(EngineConfig(model="tiny", num_kv_blocks=64))
    yield eng
    eng.shutdown()


async def collect(engine: AsyncEngine, request_id: str, prompt: str) -> list[RequestOutput]:
    return [out async for out in engine.generate(request_id, prompt, PARAMS)]


def test_concurrent_streams_get_the_same_tokens_as_one_at_a_time(engine: AsyncEngine) -> None:
    async def main() -> tuple[list[list[RequestOutput]], list[list[RequestOutput]]]:
        together = await asyncio.gather(
            *(collect(engine, f"c{i}", p) for i, p in enumerate(PROMPTS))
        )
        alone = [await collect(engine, f"s{i}", p) for i, p in enumerate(PROMPTS)]
        return together, alone

    together, alone = asyncio.run(main())
    for a, b in zip(together, alone, strict=True):
        assert a[-1].token_ids == b[-1].token_ids and a[-1].finish_reason == "length"
        # The deltas add up to the whole completion.
        assert [t for out in a for t in out.new_token_ids] == a[-1].token_ids
    engine.check_integrity()


def test_leaving_a_stream_early_aborts_and_frees_its_blocks(engine: AsyncEngine) -> None:
    async def main() -> None:
        stream = engine.generate("quit", "A prompt", SamplingParams(max_tokens=200, ignore_eos=True))
        async for out in stream:
            if len(out.token_ids) >= 3:
                break
        await stream.aclose()

    asyncio.run(main())
    for _ in range(200):  # the abort is applied by the engine thread between steps
        stats = engine.stats()
        if stats.num_running == 0 and stats.live == 0:
            break
        asyncio.run(asyncio.sleep(0.01))
    assert stats.live == 0 and stats.num_running == 0, stats
    engine.check_integrity()


def test_cancelling_the_consuming_task_aborts_the_request(engine: AsyncEngine) -> None:
    async def main() -> None:
        started = asyncio.Event()

        async def consume() -> None:
            async for _ in engine.generate("cancel", "Prompt", SamplingParams(max_tokens=200, ignore_eos=True)):
                started.set()

        task = asyncio.create_task(consume())
        await started.wait()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        # A later request still runs to completion on the same engine.
        outs = await collect(engine, "after", "Prompt")
        assert outs[-1].finish_reason == "length"

    asyncio.run(main())
    stats = engine.stats()
    assert stats.live == 0 and stats.num_running == 0, stats


def test_a_bad_request_raises_from_the_stream(engine: AsyncEngine) -> None:
    async def main() -> None:
        with pytest.raises(RequestError, match="prompt is empty"):
            async for _ in engine.generate("bad", [], PARAMS):
                pass

    asyncio.run(main())

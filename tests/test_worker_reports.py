"""A worker's load reports while its engine is inside a long step (a long prompt's
prefill chunk on a slow CPU): the report goes on time, with the state read after
the previous step, how long this one has run, and no KV event drained; a poll of
the engine's counters meanwhile waits without holding the actor's event loop.

A `WorkerActor` is a plain class: here it runs in-process around a tiny engine
whose forward is made to take a second, as on a machine far slower than this one.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from pagefleet import SamplingParams
from pagefleet.worker.actor import WorkerActor
from pagefleet.worker.config import EngineConfig
from pagefleet.worker.events import KVEventBatch, LoadReport
from pagefleet.worker.wire import WorkerRequest

STEP_S = 1.0  # each forward, as slowed down here
WAIT_S = 0.2  # the report's wait for the step to end (the report loop's report_interval_s)


async def _report(
    actor: WorkerActor, wait_s: float | None, snapshot: bool = False
) -> tuple[LoadReport, KVEventBatch, float, bool]:
    started = time.monotonic()
    report, batch, as_asked = await actor._next_report(snapshot=snapshot, wait_s=wait_s)
    took = time.monotonic() - started
    return report, batch, took, as_asked


def test_a_report_during_a_long_step_goes_on_time_with_the_last_state_and_the_steps_age() -> None:
    config = EngineConfig(model="tiny", block_size=4, num_kv_blocks=64)
    actor = WorkerActor("w0", "default", config, report_interval_s=0)
    runner = actor._engine.engine.runner
    forward = runner.execute

    def slow_forward(*args: Any, **kwargs: Any) -> Any:
        time.sleep(STEP_S)
        return forward(*args, **kwargs)

    runner.execute = slow_forward

    async def main() -> list[tuple[LoadReport, KVEventBatch, float, bool]]:
        reports = [await _report(actor, WAIT_S)]  # idle: read at once
        prompt = tuple(range(5, 45))  # 10 blocks' worth of prompt, one prefill step
        params = SamplingParams(max_tokens=2, ignore_eos=True)
        stream = actor.generate(WorkerRequest("r0@r1", prompt, params))
        reading = asyncio.ensure_future(_drain(stream))
        while actor._engine.step_seconds() == 0.0:
            await asyncio.sleep(0.01)
        # A poll of the engine's counters waits for the step's end on a thread: the
        # report still goes on time.
        polling = asyncio.ensure_future(actor.stats())
        # Inside the prefill step, asked for a snapshot (the scheduler's index drifted).
        reports.append(await _report(actor, WAIT_S, snapshot=True))
        assert not polling.done()
        await asyncio.gather(reading, polling)
        reports.append(await _report(actor, WAIT_S))  # after it: between steps
        return reports

    try:
        (idle, *_), (busy, busy_batch, waited, busy_as_asked), (done, done_batch, *_) = asyncio.run(main())
    finally:
        actor._engine.shutdown()
    # Inside the step: on time, the idle state again (nothing computed yet, no events
    # drained, the snapshot still owed), and the step's age so far.
    assert waited < STEP_S
    assert busy.seq == idle.seq + 1 and busy.progress == idle.progress == 0
    assert busy.live_blocks == idle.live_blocks and busy.num_running == idle.num_running == 0
    assert WAIT_S <= busy.step_s < STEP_S
    assert busy_batch.events == () and not busy_batch.reset and not busy_as_asked
    # After it: the prompt and the generated token (the second one's input) counted as
    # computed, the prompt's full blocks as stored events, and no step running.
    assert done.progress == 40 + 1 and done.step_s == 0.0
    assert [kind for kind, _ in done_batch.events] == ["stored"] * 10


async def _drain(stream: Any) -> None:
    async for _ in stream:
        pass

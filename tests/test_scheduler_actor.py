"""The scheduler actor on a real local Ray: naming, reports over msgpack, restart and re-registration."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest

ray = pytest.importorskip("ray")

from pagefleet.scheduler.actor import (  # noqa: E402
    SCHEDULER_NAME,
    ReportAck,
    get_scheduler,
    start_scheduler,
)
from pagefleet.scheduler.state import WorkerInfo  # noqa: E402
from pagefleet.worker.events import LoadReport  # noqa: E402

pytestmark = pytest.mark.cluster

NAMESPACE = "pagefleet-test-scheduler"


@pytest.fixture(scope="module")
def ray_session() -> Iterator[None]:
    started = not ray.is_initialized()
    if started:
        ray.init(num_cpus=2, include_dashboard=False, namespace=NAMESPACE, log_to_driver=False)
    yield
    if started:
        ray.shutdown()


@pytest.fixture
def scheduler(ray_session: None) -> Iterator[Any]:
    handle = start_scheduler(namespace=NAMESPACE, report_timeout_s=30.0)
    yield handle
    ray.kill(handle, no_restart=True)


def report(worker_id: str, seq: int = 1) -> bytes:
    return LoadReport(worker_id, "chat", seq, 0.0, 64, 60, 4, 0, 4).encode()


def wait_for_restart(handle: Any, old_generation: int) -> None:
    # ray.kill returns before the actor is gone; the handle's calls are retried
    # against the restarted actor, so poll until the new incarnation answers.
    deadline = time.monotonic() + 60
    while ray.get(handle.generation.remote(), timeout=60) == old_generation:
        assert time.monotonic() < deadline, "scheduler did not restart within 60 s"
        time.sleep(0.1)


def test_actor_is_found_by_name(scheduler: Any) -> None:
    found = get_scheduler(NAMESPACE)
    assert found is not None
    assert ray.get(found.generation.remote()) == ray.get(scheduler.generation.remote())
    assert SCHEDULER_NAME == "pagefleet-scheduler"


def test_starting_twice_returns_the_same_actor(scheduler: Any) -> None:
    again = start_scheduler(namespace=NAMESPACE)
    assert ray.get(again.generation.remote()) == ray.get(scheduler.generation.remote())


def test_registered_worker_reports_and_appears_in_the_view(scheduler: Any) -> None:
    generation = ray.get(scheduler.register_worker.remote(WorkerInfo("w0", "chat", 64)))
    ack = ray.get(scheduler.report.remote("w0", report("w0")))
    assert ack == ReportAck(generation, True)
    view = ray.get(scheduler.get_view.remote())
    assert [(w.worker_id, w.alive, w.report.free_blocks) for w in view.workers] == [
        ("w0", True, 60)
    ]


def test_unknown_worker_is_told_to_register(scheduler: Any) -> None:
    ack = ray.get(scheduler.report.remote("ghost", report("ghost")))
    assert ack.registered is False


def test_restarted_scheduler_has_a_new_generation_and_rebuilds_from_re_registration(
    scheduler: Any,
) -> None:
    first = ray.get(scheduler.register_worker.remote(WorkerInfo("w0", "chat", 64)))
    ray.kill(scheduler, no_restart=False)
    wait_for_restart(scheduler, first)
    ack = ray.get(scheduler.report.remote("w0", report("w0", 2)))
    assert ack.registered is False
    assert ack.generation != first
    assert ray.get(scheduler.get_view.remote()).workers == ()
    ray.get(scheduler.register_worker.remote(WorkerInfo("w0", "chat", 64)))
    assert ray.get(scheduler.report.remote("w0", report("w0", 3))).registered


def test_no_scheduler_in_an_empty_namespace(ray_session: None) -> None:
    assert get_scheduler("pagefleet-test-nobody-here") is None

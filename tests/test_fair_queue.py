"""The ingress wait queue: bounded per pool, tenants dispatched by weighted fair queueing."""

from __future__ import annotations

import pytest

from pagefleet.scheduler.fair_queue import FairWaitQueue
from pagefleet.scheduler.policy import ResourceExhausted


def _drain(queue: FairWaitQueue[str], pool: str) -> list[str]:
    order = []
    while (head := queue.pop(pool)) is not None:
        order.append(head[0])
    return order


# ----- one tenant: the plain bounded FIFO ---------------------------------------


def test_one_tenant_waits_fifo_per_pool() -> None:
    queue: FairWaitQueue[str] = FairWaitQueue(4)
    queue.push("chat", "a", "r1", "x")
    queue.push("batch", "a", "r2", "y")
    queue.push("chat", "a", "r3", "z")
    assert queue.pop("chat") == ("r1", "x")
    assert queue.pop("chat") == ("r3", "z")
    assert queue.pop("chat") is None
    assert len(queue) == 1


def test_past_the_bound_push_raises_resource_exhausted() -> None:
    queue: FairWaitQueue[int] = FairWaitQueue(2)
    queue.push("chat", "a", "r1", 1)
    queue.push("chat", "a", "r2", 2)
    with pytest.raises(ResourceExhausted, match="2 requests waiting") as info:
        queue.push("chat", "a", "r3", 3)
    assert info.value.code == "RESOURCE_EXHAUSTED"
    assert queue.size("chat") == 2


def test_the_bound_is_per_pool() -> None:
    queue: FairWaitQueue[int] = FairWaitQueue(1)
    queue.push("chat", "a", "r1", 1)
    queue.push("batch", "a", "r2", 2)
    assert queue.size("batch") == 1


def test_a_zero_bound_refuses_every_request() -> None:
    queue: FairWaitQueue[int] = FairWaitQueue(0)
    with pytest.raises(ResourceExhausted):
        queue.push("chat", "a", "r1", 1)


def test_a_removed_request_frees_its_place_and_its_id() -> None:
    queue: FairWaitQueue[int] = FairWaitQueue(1)
    queue.push("chat", "a", "r1", 1)
    assert queue.remove("r1")
    assert "r1" not in queue
    assert not queue.remove("r1")
    queue.push("chat", "a", "r1", 1)


def test_a_request_cannot_wait_twice() -> None:
    queue: FairWaitQueue[int] = FairWaitQueue(2)
    queue.push("chat", "a", "r1", 1)
    with pytest.raises(ValueError, match="already waiting"):
        queue.push("chat", "b", "r1", 1)


def test_peek_shows_the_next_request_without_removing_it() -> None:
    queue: FairWaitQueue[str] = FairWaitQueue(4)
    queue.push("chat", "a", "r1", "x")
    queue.push("chat", "a", "r2", "y")
    assert queue.peek("chat") == ("r1", "x")
    assert queue.peek("chat") == ("r1", "x")
    assert queue.peek("batch") is None
    assert queue.size("chat") == 2


def test_get_finds_a_waiting_item_by_request_id() -> None:
    queue: FairWaitQueue[str] = FairWaitQueue(4)
    queue.push("chat", "a", "r1", "x")
    assert queue.get("r1") == "x"
    queue.remove("r1")
    assert queue.get("r1") is None


# ----- several tenants: fair order ------------------------------------------------


def test_equal_tenants_alternate_whatever_their_backlog() -> None:
    queue: FairWaitQueue[str] = FairWaitQueue(16, {"chat": {"a": 1, "b": 1}})
    for i in range(4):
        queue.push("chat", "a", f"a{i}", "")
    queue.push("chat", "b", "b0", "")
    queue.push("chat", "b", "b1", "")
    assert _drain(queue, "chat") == ["a0", "b0", "a1", "b1", "a2", "a3"]


def test_a_newcomer_goes_before_the_backlog_of_a_tenant_that_has_been_flooding() -> None:
    queue: FairWaitQueue[str] = FairWaitQueue(64, {"chat": {"a": 1, "b": 1}})
    for i in range(20):
        queue.push("chat", "a", f"a{i}", "")
    for _ in range(10):
        queue.pop("chat")  # a has been served alone for a while
    queue.push("chat", "b", "b0", "")
    assert queue.peek("chat") == ("b0", "")


def test_an_idle_tenant_earns_no_credit_for_its_idle_time() -> None:
    queue: FairWaitQueue[str] = FairWaitQueue(64, {"chat": {"a": 1, "b": 1}})
    for i in range(10):
        queue.push("chat", "a", f"a{i}", "")
    for _ in range(8):
        queue.pop("chat")
    for i in range(3):
        queue.push("chat", "b", f"b{i}", "")
    # b starts from the pool's clock, not from 0: it does not get 8 turns in a row.
    assert _drain(queue, "chat")[:4] == ["b0", "a8", "b1", "a9"]


def test_dispatch_follows_the_weights() -> None:
    queue: FairWaitQueue[str] = FairWaitQueue(64, {"chat": {"a": 3, "b": 1}})
    for i in range(9):
        queue.push("chat", "a", f"a{i}", "")
        queue.push("chat", "b", f"b{i}", "")
    first_eight = _drain(queue, "chat")[:8]
    assert sum(r.startswith("a") for r in first_eight) == 6
    assert sum(r.startswith("b") for r in first_eight) == 2


def test_each_tenant_is_fifo() -> None:
    queue: FairWaitQueue[str] = FairWaitQueue(64, {"chat": {"a": 2, "b": 1}})
    for i in range(6):
        queue.push("chat", "a", f"a{i}", "")
        queue.push("chat", "b", f"b{i}", "")
    order = _drain(queue, "chat")
    assert [r for r in order if r.startswith("a")] == [f"a{i}" for i in range(6)]
    assert [r for r in order if r.startswith("b")] == [f"b{i}" for i in range(6)]


def test_removing_a_waiting_request_does_not_charge_its_tenant() -> None:
    queue: FairWaitQueue[str] = FairWaitQueue(64, {"chat": {"a": 1, "b": 1}})
    for i in range(4):
        queue.push("chat", "a", f"a{i}", "")
        queue.push("chat", "b", f"b{i}", "")
    queue.remove("a0")
    queue.remove("a1")
    # a2 takes a0's place in virtual time (charged, a would be two turns behind b).
    assert _drain(queue, "chat")[:4] == ["b0", "a2", "b1", "a3"]


# ----- several tenants: fair share of the bound -------------------------------------


def test_a_flooding_tenant_cannot_fill_the_queue_of_a_shared_pool() -> None:
    queue: FairWaitQueue[int] = FairWaitQueue(8, {"chat": {"a": 1, "b": 1}})
    for i in range(4):
        queue.push("chat", "a", f"a{i}", i)
    with pytest.raises(ResourceExhausted, match="tenant 'a' has 4 requests waiting, its share"):
        queue.push("chat", "a", "a4", 4)
    for i in range(4):
        queue.push("chat", "b", f"b{i}", i)
    assert queue.size("chat", "a") == queue.size("chat", "b") == 4


def test_shares_follow_the_weights() -> None:
    queue: FairWaitQueue[int] = FairWaitQueue(12, {"chat": {"a": 3, "b": 1}})
    assert queue.share("chat", "a") == 9
    assert queue.share("chat", "b") == 3


def test_a_tenant_alone_in_its_pool_may_fill_the_whole_queue() -> None:
    queue: FairWaitQueue[int] = FairWaitQueue(6, {"chat": {"a": 1}, "batch": {"b": 1}})
    assert queue.share("chat", "a") == 6


def test_a_guest_tenant_shares_the_bound_with_the_pool_s_home_tenants() -> None:
    queue: FairWaitQueue[int] = FairWaitQueue(6, {"chat": {"a": 1, "b": 1}})
    assert queue.share("chat", "guest") == 2
    assert queue.share("batch", "guest") == 6


def test_every_tenant_may_queue_at_least_one_request() -> None:
    queue: FairWaitQueue[int] = FairWaitQueue(2, {"chat": {t: 1 for t in "abcde"}})
    assert queue.share("chat", "e") == 1


def test_weights_must_be_positive() -> None:
    with pytest.raises(ValueError, match="weight must be > 0"):
        FairWaitQueue(4, {"chat": {"a": 0}})


def test_requests_routed_without_waiting_count_in_the_fair_order() -> None:
    queue: FairWaitQueue[str] = FairWaitQueue(64, {"chat": {"a": 1, "b": 1}})
    for _ in range(5):
        queue.charge("chat", "a")  # a's flood went straight to workers
    queue.push("chat", "a", "a5", "")
    queue.push("chat", "b", "b0", "")
    assert queue.peek("chat") == ("b0", "")


def test_a_tenant_s_higher_priority_requests_go_first_fifo_among_equals() -> None:
    queue: FairWaitQueue[str] = FairWaitQueue(8)
    for request_id, priority in [("low1", 0), ("high1", 5), ("low2", 0), ("high2", 5)]:
        queue.push("p", "a", request_id, request_id, priority)
    assert [queue.pop("p") for _ in range(4)] == [
        ("high1", "high1"), ("high2", "high2"), ("low1", "low1"), ("low2", "low2")
    ]


def test_priority_does_not_buy_a_tenant_more_than_its_fair_turn() -> None:
    queue: FairWaitQueue[str] = FairWaitQueue(8)
    queue.charge("p", "a")  # a just had its turn
    queue.push("p", "a", "a-urgent", "a-urgent", 100)
    queue.push("p", "b", "b-plain", "b-plain", 0)
    assert queue.pop("p") == ("b-plain", "b-plain")
    assert queue.pop("p") == ("a-urgent", "a-urgent")

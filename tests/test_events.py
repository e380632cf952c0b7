"""Load reports and KV event batches: msgpack round trips and refusal of garbage."""

from __future__ import annotations

import contextlib

import msgpack
import pytest
from engine_stats import engine_stats
from hypothesis import given
from hypothesis import strategies as st

from pagefleet.worker.events import (
    WIRE_VERSION,
    EventDecodeError,
    KVEventBatch,
    LoadReport,
    RequestLoad,
    decode_message,
)


def make_report(**overrides: object) -> LoadReport:
    fields: dict[str, object] = dict(
        worker_id="w0",
        pool="chat",
        seq=7,
        timestamp=1234.5,
        total_blocks=100,
        free_blocks=40,
        live_blocks=35,
        cached_blocks=25,
        peak_live_blocks=60,
        num_running=3,
        num_waiting=1,
        tenant_live_blocks={"acme": 20, "globex": 15},
        preemptions={"recompute": 2, "swap": 1},
        evictions=9,
        prefix_query_tokens=640,
        prefix_hit_tokens=320,
        progress=5120,
        step_s=4.75,
        committed_blocks=12,
        priority_claims={0: (2, 30), 5: (1, 8)},
        origin_claims={"replica-a": 38},
        migrations_out=4,
        recompute_s_per_token=2.5e-4,
        kv_import_s_per_block=1.25e-5,
        resident_adapters=("beta", "alpha"),
        lora_slots=4,
        lora_loads={"alpha": 3, "beta": 1},
        lora_evictions={"alpha": 2},
    )
    fields.update(overrides)
    return LoadReport(**fields)  # type: ignore[arg-type]


def test_load_report_round_trips_every_field() -> None:
    report = make_report()
    assert LoadReport.decode(report.encode()) == report


@pytest.mark.parametrize("name", ["kv_import_s_per_block", "step_s"])
@pytest.mark.parametrize("bad", [-1.0, float("inf"), float("nan"), True, "0.1"])
def test_a_measured_cost_that_is_no_finite_non_negative_number_is_refused(
    name: str, bad: object
) -> None:
    obj = msgpack.unpackb(make_report().encode())
    obj[name] = bad
    with pytest.raises(EventDecodeError, match=name):
        LoadReport.decode(msgpack.packb(obj))


def test_a_report_missing_a_field_is_refused_naming_it() -> None:
    obj = msgpack.unpackb(make_report().encode())
    del obj["recompute_s_per_token"]
    with pytest.raises(EventDecodeError, match="missing field 'recompute_s_per_token'"):
        LoadReport.decode(msgpack.packb(obj))


def test_load_report_of_a_worker_short_of_blocks_round_trips_its_requests() -> None:
    report = make_report(
        blocks_short=3, requests=(RequestLoad("a@r1", 0, 4, 57), RequestLoad("b@r1", -2, 9, 12))
    )
    decoded = LoadReport.decode(report.encode())
    assert decoded == report and decoded.requests[1].priority == -2


def test_kv_event_batch_round_trips_in_order() -> None:
    batch = KVEventBatch(
        "w1", 3, (("stored", b"a" * 32), ("removed", b"a" * 32), ("stored", b"b" * 32))
    )
    assert KVEventBatch.decode(batch.encode()) == batch


def test_kv_event_batch_round_trips_reset_flag() -> None:
    batch = KVEventBatch("w1", 0, (), reset=True)
    assert KVEventBatch.decode(batch.encode()).reset is True


@given(
    st.lists(st.tuples(st.sampled_from(["stored", "removed"]), st.binary(min_size=1, max_size=40)))
)
def test_kv_event_batch_round_trips_any_events(events: list[tuple[str, bytes]]) -> None:
    batch = KVEventBatch.from_engine("w", 1, events)
    assert KVEventBatch.decode(batch.encode()).events == tuple(events)


def test_kv_event_batch_round_trips_the_adapter_of_each_event() -> None:
    events = (("stored", b"a"), ("stored", b"b"), ("removed", b"c"))
    batch = KVEventBatch.from_engine("w", 1, events, adapters=("alpha", "", "beta"))
    assert KVEventBatch.decode(batch.encode()).adapters == ("alpha", "", "beta")


def test_a_kv_event_batch_without_adapters_decodes_as_all_base_model() -> None:
    batch = KVEventBatch("w", 1, (("stored", b"a"),))
    assert "adapters" not in msgpack.unpackb(batch.encode())
    assert KVEventBatch.decode(batch.encode()).adapters == ()


def test_a_kv_event_batch_needs_one_adapter_per_event() -> None:
    with pytest.raises(ValueError, match="one per event: 1 for 2 events"):
        KVEventBatch("w", 1, (("stored", b"a"), ("stored", b"b")), adapters=("alpha",))


def test_decode_message_dispatches_on_kind() -> None:
    report = make_report()
    batch = KVEventBatch("w0", 1, (("stored", b"h"),))
    assert decode_message(report.encode()) == report
    assert decode_message(batch.encode()) == batch


@pytest.mark.parametrize(
    "data",
    [
        b"",
        b"\xc1",
        b"not msgpack at all \xff\xfe",
        msgpack.packb([1, 2, 3]),
        msgpack.packb({"v": 1}),
    ],
)
def test_decoding_garbage_raises_event_decode_error(data: bytes) -> None:
    with pytest.raises(EventDecodeError):
        decode_message(data)
    with pytest.raises(EventDecodeError):
        LoadReport.decode(data)
    with pytest.raises(EventDecodeError):
        KVEventBatch.decode(data)


@given(st.binary(max_size=200))
def test_decoding_random_bytes_never_raises_anything_but_event_decode_error(data: bytes) -> None:
    for decode in (decode_message, LoadReport.decode, KVEventBatch.decode):
        with contextlib.suppress(EventDecodeError):
            decode(data)


def test_other_wire_version_is_refused() -> None:
    obj = msgpack.unpackb(make_report().encode())
    obj["v"] = WIRE_VERSION + 1
    with pytest.raises(EventDecodeError, match="wire version"):
        LoadReport.decode(msgpack.packb(obj))


def test_field_of_wrong_type_is_refused() -> None:
    obj = msgpack.unpackb(make_report().encode())
    obj["free"] = "forty"
    with pytest.raises(EventDecodeError, match="'free'"):
        LoadReport.decode(msgpack.packb(obj))


def test_missing_field_is_refused() -> None:
    obj = msgpack.unpackb(make_report().encode())
    del obj["live"]
    with pytest.raises(EventDecodeError, match="missing field 'live'"):
        LoadReport.decode(msgpack.packb(obj))


def test_kv_batch_is_not_decoded_as_load_report() -> None:
    with pytest.raises(EventDecodeError, match="kind"):
        LoadReport.decode(KVEventBatch("w", 1).encode())


def test_kv_events_with_mismatched_lengths_are_refused() -> None:
    obj = msgpack.unpackb(KVEventBatch("w", 1, (("stored", b"x"),)).encode())
    obj["hashes"] = []
    with pytest.raises(EventDecodeError, match="1 event types for 0 hashes"):
        KVEventBatch.decode(msgpack.packb(obj, use_bin_type=True))


def test_unknown_kv_event_type_is_rejected_at_construction() -> None:
    with pytest.raises(ValueError, match="'stored' or 'removed'"):
        KVEventBatch("w", 1, (("evicted", b"x"),))


def test_report_from_engine_stats_reads_pool_counters() -> None:
    stats = engine_stats(
        total=64, free=10, live=30, cached=24, peak_live=50,
        prefix_query_tokens=100, prefix_hit_tokens=40, evictions=3,
        num_running=4, num_waiting=2, preemptions_recompute=5,
    )  # fmt: skip
    report = LoadReport.from_engine_stats("w3", "chat", 11, stats, timestamp=1.0)
    assert (report.total_blocks, report.free_blocks, report.live_blocks) == (64, 10, 30)
    assert (report.cached_blocks, report.peak_live_blocks) == (24, 50)
    assert (report.num_running, report.num_waiting, report.evictions) == (4, 2, 3)
    assert report.preemptions == {"recompute": 5, "swap": 0}
    assert report.hit_rate == pytest.approx(0.4)


def test_report_from_engine_stats_counts_preemptions_by_mode() -> None:
    stats = engine_stats(total=8, preemptions_recompute=2, preemptions_swap=1)
    report = LoadReport.from_engine_stats("w", "p", 1, stats)
    assert report.total_blocks == 8
    assert report.preemptions == {"recompute": 2, "swap": 1}


def test_hit_rate_is_zero_before_any_query() -> None:
    assert make_report(prefix_query_tokens=0, prefix_hit_tokens=0).hit_rate == 0.0


def test_report_from_a_real_block_pools_counters() -> None:
    from pagefleet.worker.block_pool import BlockPool

    pool = BlockPool(32, block_size=16)
    blocks = pool.allocate(5)
    pool.register(blocks[0], b"h" * 32)
    pool.free(blocks[:1])
    report = LoadReport.from_engine_stats("w", "p", 1, engine_stats(**pool.stats().as_dict()))
    assert (report.total_blocks, report.live_blocks, report.cached_blocks) == (32, 4, 1)
    assert report.free_blocks == 27
    assert report.peak_live_blocks == 5


def test_incarnation_round_trips() -> None:
    report = make_report(incarnation="abc")
    assert LoadReport.decode(report.encode()).incarnation == "abc"


def test_report_of_a_new_incarnation_supersedes_a_higher_seq() -> None:
    old = make_report(seq=50, incarnation="a")
    assert make_report(seq=1, incarnation="b").supersedes(old)
    assert not make_report(seq=49, incarnation="a").supersedes(old)
    assert make_report(seq=51, incarnation="a").supersedes(old)


def test_lowest_priority_and_the_blocks_claimed_below_a_priority() -> None:
    report = make_report(priority_claims={0: (2, 30), 3: (1, 4), 5: (1, 8)})
    assert report.lowest_priority == 0
    assert report.claimed_below(5) == 34
    assert report.claimed_below(0) == 0


@pytest.mark.parametrize("claims", [{"x": [1, 2]}, {"0": [1]}, {"0": [True, 2]}, {"0": 3}])
def test_malformed_priority_claims_are_refused(claims: object) -> None:
    obj = msgpack.unpackb(make_report().encode())
    obj["priority_claims"] = claims
    with pytest.raises(EventDecodeError, match="priority_claims"):
        LoadReport.decode(msgpack.packb(obj))

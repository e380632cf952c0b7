"""Noticing the loss of the Ray GCS, the head node's control store.

Every ingress replica, and `pagefleet serve` on a joined cluster, probe the
GCS (a one-second key lookup every half second) and feed the answers to a
`GcsWatch`, which says when the GCS is lost for good:

- Without GCS fault tolerance (`server.gcs_fault_tolerance: false`, the
  default) a cluster whose GCS died cannot recover: Ray's raylets and drivers
  give up after `gcs_rpc_server_reconnect_timeout_s`, and until then
  completions hang. So the GCS is lost after `lost_after` unanswered probes in
  a row: the ingress stops accepting (health NOT_SERVING, new requests
  UNAVAILABLE) and `pagefleet serve` exits non-zero so that its supervisor
  starts a fresh server.
- With it (the head started with an external Redis, `RAY_REDIS_ADDRESS`;
  KubeRay's `gcsFaultToleranceOptions`) a dead GCS is restarted from Redis and
  every Ray process reconnects to it; the actors keep calling each other
  meanwhile, so streams go on. The GCS is lost only once it has been away for
  `tolerate_s`: a little less than Ray's reconnect timeout, after which Ray
  ends every process that is still waiting for it (`std::_Exit`), so that the
  server says why before Ray ends it without a word.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Callable

logger = logging.getLogger(__name__)

PROBE_TIMEOUT_S = 1.0
PROBE_INTERVAL_S = 0.5
# Without fault tolerance: this many unanswered probes in a row are a loss (one slow
# answer on a busy head is not).
PROBES_LOST = 3
# Ray's default `gcs_rpc_server_reconnect_timeout_s` (src/ray/common/ray_config_def.h).
RAY_RECONNECT_TIMEOUT_DEFAULT_S = 60.0
RECONNECT_TIMEOUT_ENV = "RAY_gcs_rpc_server_reconnect_timeout_s"
# With fault tolerance: give up this long before Ray's own reconnect timeout ends the process.
GIVE_UP_MARGIN_S = 5.0


def ray_reconnect_timeout_s(environ: dict[str, str] | None = None) -> float:
    """How long this process's Ray waits for a lost GCS before it exits: the
    `RAY_gcs_rpc_server_reconnect_timeout_s` it was started with (Ray's processes
    inherit the head's), else Ray's default of 60 s."""
    env = os.environ if environ is None else environ
    raw = env.get(RECONNECT_TIMEOUT_ENV, "").strip()
    try:
        value = float(raw) if raw else RAY_RECONNECT_TIMEOUT_DEFAULT_S
    except ValueError:
        return RAY_RECONNECT_TIMEOUT_DEFAULT_S  # Ray itself would refuse to start on it
    return value if value > 0 else RAY_RECONNECT_TIMEOUT_DEFAULT_S


def tolerance_s(reconnect_timeout_s: float) -> float:
    """How long a fault-tolerant server serves on without its GCS: `GIVE_UP_MARGIN_S`
    short of Ray's reconnect timeout (and at least three probes' worth)."""
    return max(reconnect_timeout_s - GIVE_UP_MARGIN_S, PROBES_LOST * PROBE_INTERVAL_S)


class GcsWatch:
    """Turns a sequence of GCS probe answers into "lost for good" (see the module docstring).

    `observe(answered)` after each probe; it returns why the GCS is lost (one line)
    once it is, None before. The `clock` is a parameter so that the rule can be
    checked without waiting for it.
    """

    def __init__(
        self,
        *,
        fault_tolerant: bool,
        lost_after: int = PROBES_LOST,
        tolerate_s: float | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.fault_tolerant = fault_tolerant
        self.lost_after = lost_after
        self.tolerate_s = tolerance_s(ray_reconnect_timeout_s()) if tolerate_s is None else tolerate_s
        self._clock = clock
        self._unanswered = 0
        # Ray counts its reconnect timeout from the GCS's last sign of life, so the outage
        # is measured from the last answer too (the GCS answered `ray.init` before this).
        self._last_answer = clock()
        self._away = False

    @property
    def away_s(self) -> float:
        """Seconds since the GCS last answered, while it does not (0 while it answers)."""
        return self._clock() - self._last_answer if self._away else 0.0

    def observe(self, answered: bool) -> str | None:
        """Count one probe's answer; why the GCS is lost for good, or None."""
        if answered:
            if self._away and self.fault_tolerant:
                logger.warning("the Ray GCS answers again after %.1fs: serving as before", self.away_s)
            self._unanswered, self._away, self._last_answer = 0, False, self._clock()
            return None
        self._unanswered += 1
        if not self._away:
            self._away = True
            if self.fault_tolerant:
                logger.warning(
                    "the Ray GCS does not answer: serving on for up to %.0fs while it restarts "
                    "(server.gcs_fault_tolerance)", self.tolerate_s,
                )  # fmt: skip
        if not self.fault_tolerant:
            if self._unanswered < self.lost_after:
                return None
            return "no GCS fault tolerance: the cluster cannot recover"
        if self.away_s < self.tolerate_s:
            return None
        return f"not back within {self.tolerate_s:.0f}s (GCS fault tolerance; Ray gives up at its reconnect timeout)"


def gcs_answers(timeout_s: float = PROBE_TIMEOUT_S) -> bool:
    """Whether the GCS this process is connected to answers a key lookup within `timeout_s`."""
    from ray._private import worker

    try:
        client = worker.global_worker.gcs_client  # type: ignore[attr-defined]  # set by ray.init
        client.internal_kv_exists(b"gcs-probe", b"pagefleet", timeout=timeout_s)
    except Exception:  # RpcError, or the GCS client gone with the connection
        return False
    return True


async def watch_gcs(
    on_lost: Callable[[], None], watch: GcsWatch, *, interval_s: float = PROBE_INTERVAL_S
) -> None:
    """Probe the GCS every `interval_s` until `watch` says it is lost, then call
    `on_lost()` once and return."""
    while True:
        why = watch.observe(await asyncio.to_thread(gcs_answers))
        if why is not None:
            logger.error("lost the Ray GCS (%s): refusing new requests", why)
            on_lost()
            return
        await asyncio.sleep(interval_s)


def forget_usage_tags_of_past_rays() -> None:
    """Call before joining a cluster: a process that started a Ray of its own before (a
    test, a benchmark) keeps that head's usage tags, and Ray writes them into every cluster
    the process joins later (a post-init hook), so the joined cluster would read this
    process's old "memory" where its head recorded "redis" (`gcs_storage`)."""
    from ray._common.usage import usage_lib

    usage_lib.reset_global_state()


def gcs_storage() -> str | None:
    """Where the cluster's GCS keeps its tables, as its head recorded it at start:
    "redis" (fault tolerant), "rocksdb", "memory"; None when not recorded."""
    from ray._private import worker

    try:
        client = worker.global_worker.gcs_client  # type: ignore[attr-defined]  # set by ray.init
        # The head's `ray start` records it among Ray's usage tags (whether or not usage
        # stats are reported): `ray._private.node.Node._record_stats`.
        value = client.internal_kv_get(b"extra_usage_tag_gcs_storage", b"usage_stats", timeout=PROBE_TIMEOUT_S * 10)
    except Exception:  # an older Ray, or no answer
        return None
    return None if value is None else bytes(value).decode()

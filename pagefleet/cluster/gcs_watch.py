"""Noticing the loss of the Ray GCS, the head node's control store.

Without GCS fault tolerance a cluster whose GCS died cannot recover: Ray's
raylets and drivers give up after `gcs_rpc_server_reconnect_timeout_s`, and
until then completions hang. So the ingress stops accepting (health
NOT_SERVING, new requests UNAVAILABLE) as soon as the GCS stops answering,
and `pagefleet serve` exits non-zero so that its supervisor starts a fresh
server. With fault tolerance (the GCS keeps its tables in an external Redis,
`RAY_REDIS_ADDRESS`), the GCS restarts and everything reconnects: nothing is
stopped.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Callable

logger = logging.getLogger(__name__)

PROBE_TIMEOUT_S = 1.0
PROBE_INTERVAL_S = 0.5


def fault_tolerant(environ: dict[str, str] | None = None) -> bool:
    """Whether this Ray's GCS keeps its state in an external Redis (and so restarts
    without losing the cluster): `RAY_REDIS_ADDRESS`, which the head and every process
    it starts inherit (KubeRay sets it on the head with GCS fault tolerance)."""
    env = os.environ if environ is None else environ
    return bool(env.get("RAY_REDIS_ADDRESS", "").strip())


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
    on_lost: Callable[[], None], *, lost_after: int, interval_s: float = PROBE_INTERVAL_S
) -> None:
    """Call `on_lost()` once `lost_after` probes in a row went unanswered, then return;
    runs while the GCS answers. Not started under fault tolerance: there a GCS restart
    is a pause, not the end."""
    unanswered = 0
    while True:
        unanswered = 0 if await asyncio.to_thread(gcs_answers) else unanswered + 1
        if unanswered >= lost_after:
            logger.error("lost the Ray GCS (no GCS fault tolerance): refusing new requests")
            on_lost()
            return
        await asyncio.sleep(interval_s)

"""Shared test set-up: no hub access, deterministic torch, small thread pools."""

from __future__ import annotations

import os
import runpy
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
# Every Ray the tests start or join runs without token auth: a process that joined one
# cluster without a token keeps that mode in Ray's config, and a local Ray it starts
# later (with a token, Ray's default) would refuse it (InvalidAuthToken).
os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Ray lowers every worker process (each actor: the engines, the ingress, the scheduler) to
# nice 15. Its GCS and raylet, this process and everything else the suite runs stay at 0,
# and on a busy 2-core machine a nice-15 actor gets about 1/30 of a core beside a nice-0
# test: a cluster's start-up then waits minutes (a `pagefleet serve --address` start, 10 s
# alone, took 150-220 s beside three busy loops). Tests share the machine with their clusters.
os.environ.setdefault("RAY_worker_niceness", "0")
# A local Ray's start waits this long for its GCS to publish its port (`start_local_ray`
# gives 120 s, for a starved machine), and it waits the whole time even when the GCS is
# already gone: in full runs a GCS started beside another test's Ray start exited before
# it wrote a log line (a zombie at once, cause not found), and the start then sat out the
# 120 s before its retry. Ray's own default, 30 s, is ample for a live GCS here.
os.environ.setdefault("RAY_gcs_server_port_wait_time_s", "30")
# Ray's own telemetry and housekeeping timers, which no test reads: its metrics and task
# events (pagefleet's metrics have a Prometheus registry of their own), per-handler event
# stats, and the raylet's memory, GC, idle-worker and disk checks polled less often. Every
# Ray the suite starts (its clusters, `ray start` nodes, `pagefleet serve`) inherits these.
# An idle cluster of `small_cluster_config`'s shape (`benchmarks/idle.py --report-interval
# 0.2 --report-timeout 2.0 --seconds 30`, two rounds each, alternating): Ray and Serve
# 8.5 and 8.3% of a core, pagefleet's actors 7.3 and 7.3%, against 6.5 and 6.7%, 6.3 and
# 6.6% with these: about a sixth of what a live cluster costs the suite while it waits.
os.environ.setdefault("RAY_enable_metrics_collection", "0")
os.environ.setdefault("RAY_task_events_report_interval_ms", "0")
os.environ.setdefault("RAY_event_stats", "0")
os.environ.setdefault("RAY_memory_monitor_refresh_ms", "1000")
os.environ.setdefault("RAY_raylet_check_gc_period_milliseconds", "1000")
os.environ.setdefault("RAY_kill_idle_workers_interval_ms", "1000")
os.environ.setdefault("RAY_local_fs_monitor_interval_ms", "5000")
# No Ray API call starts or joins a Ray by itself (Ray's auto-connect, a plain ray.init()
# that joins the cluster in Ray's address file): a thread a past module left running
# (Serve's handle loop after its Ray went) would connect this process to some other test's
# cluster, and the next module's ray.init would fail ("called ray.init twice").
os.environ["RAY_ENABLE_AUTO_CONNECT"] = "0"
# The suite runs three test processes, their clusters and the servers and benchmark smokes
# they start on two cores. An OpenMP thread that finds no work spins before it sleeps (the
# default ACTIVE policy), on a core another process is waiting for: three torch processes of
# two threads each took 12% more CPU and wall time than with PASSIVE (benchmarks/throughput.py
# --smoke, three at once). Every process the tests start inherits this.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import signal

import pytest
import torch

# A suite started in the background by a shell without job control (a CI runner, `cmd &` in a
# script) inherits SIGINT ignored, as POSIX has it, and so would every process it starts: a
# Python one (Ray's `serve run`) then installs no KeyboardInterrupt handler and never hears a
# test's SIGINT. Handle it as in a terminal; the processes started from here get the default.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)

# Under pytest-xdist each test process (the README runs three) gets one thread.
torch.set_num_threads(1 if os.environ.get("PYTEST_XDIST_WORKER") else 2)

# Ray's driver waits this long for a lost GCS before its shutdown returns (its default
# gcs_rpc_server_reconnect_timeout_s is 60 s), and a little more.
RAY_SHUTDOWN_WAIT_S = 75.0

if not torch.cuda.is_available():
    # Triton sets up its CPU interpreter only if TRITON_INTERPRET is set when triton is
    # first imported, and transformers imports triton: this must precede every test module.
    os.environ.setdefault("TRITON_INTERPRET", "1")


BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


@pytest.fixture
def run_benchmark(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> Iterator[Callable[..., str]]:
    """`run_benchmark(script, *args)` runs `benchmarks/<script>` as `__main__` in this process,
    as `python benchmarks/<script> *args` would (its directory first on `sys.path`), and
    returns its stdout; it fails if the script exits non-zero. A process of its own would
    spend seconds of CPU importing torch and transformers, which this one has already.
    The environment, torch's thread count and `sys.path` are restored afterwards."""
    environ, threads = dict(os.environ), torch.get_num_threads()
    monkeypatch.syspath_prepend(str(BENCHMARKS))

    def run(script: str, *args: str) -> str:
        monkeypatch.setattr(sys, "argv", [str(BENCHMARKS / script), *args])
        try:
            runpy.run_path(str(BENCHMARKS / script), run_name="__main__")
        except SystemExit as done:
            assert done.code in (0, None), f"{script} exited {done.code}"
        return capsys.readouterr().out

    yield run
    os.environ.clear()
    os.environ.update(environ)
    torch.set_num_threads(threads)


def _module_rank(items: list[pytest.Item]) -> int:
    """0 for a module that starts a Ray cluster, 1 for one marked slow, 2 for the rest."""
    marks = {mark.name for item in items for mark in item.iter_markers()}
    return 0 if "cluster" in marks else 1 if "slow" in marks else 2


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The cluster modules first, then the slow ones, each module's tests kept together and
    in order: pytest-xdist's `--dist loadfile` hands out modules in this order (pyproject's
    `--no-loadscope-reorder`: by default it re-sorts them by test count), so the long
    ones start early and the short ones fill the end, instead of one cluster module
    running alone at the end while the other test processes sit idle."""
    modules: dict[str, list[pytest.Item]] = {}
    for item in items:
        modules.setdefault(item.nodeid.split("::", 1)[0], []).append(item)
    ordered = sorted(modules.values(), key=_module_rank)  # stable: file order within a rank
    items[:] = [item for module in ordered for item in module]


@pytest.fixture(scope="module", autouse=True)
def _no_ray_left_connected() -> Iterator[None]:
    """Each module starts without Ray connected in this process, whichever module ran
    before it here (pytest-xdist runs modules in any order on each process). A module
    that lost its GCS leaves `ray.shutdown` finishing in a thread (`stop_local_ray`),
    waiting out Ray's GCS reconnect timeout; Ray counts itself uninitialized as soon as
    that shutdown begins, and a `ray.init` before it ends fails ("called ray.init
    twice"): wait for the thread, then end any Ray left."""
    yield
    if "ray" not in sys.modules:
        return
    import threading

    import ray

    from pagefleet.cluster.app import RAY_SHUTDOWN_THREAD

    deadline = time.monotonic() + RAY_SHUTDOWN_WAIT_S
    for thread in threading.enumerate():
        if thread.name == RAY_SHUTDOWN_THREAD:
            thread.join(timeout=max(0.0, deadline - time.monotonic()))
    if ray.is_initialized():
        ray.shutdown()

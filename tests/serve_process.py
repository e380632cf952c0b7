"""`pagefleet serve` and `ray start --head` as subprocesses, for start/stop/failure tests.

Each runs as the leader of its own session (`start_new_session`), and every
process it starts (Ray's GCS, raylet, agents, the actors' workers) stays in
that session, so "no process of the server survives its stop" is checked by
session id, and a failed test still kills exactly what it started.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from pathlib import Path

import psutil
import yaml
from cluster_fixtures import wait_for
from ray_nodes import free_port

REPO = Path(__file__).resolve().parent.parent
START_TIMEOUT_S = 300.0  # a loaded CI machine starts Ray and loads the tiny model slowly


def subprocess_env(**extra: str) -> dict[str, str]:
    """This tree's code on the path of every process the subprocess starts."""
    path = str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")
    # Ray's own start-up waits get room on a busy machine.
    return {**os.environ, "PYTHONPATH": path, "RAY_raylet_start_wait_time_s": "120", **extra}


def session_processes(leader: int) -> list[psutil.Process]:
    """Running processes (zombies aside) of the session `leader` leads, the leader included."""
    found = []
    for proc in psutil.process_iter(["status"]):
        try:
            if os.getsid(proc.pid) == leader and proc.info["status"] != psutil.STATUS_ZOMBIE:
                found.append(proc)
        except (ProcessLookupError, PermissionError, psutil.Error):
            continue
    return found


def kill_session(leader: int) -> None:
    """SIGKILL every process of the session (cleanup after a failed test)."""
    for proc in session_processes(leader):
        with suppress(psutil.Error):
            proc.kill()


class ServeProcess:
    """One `python -m pagefleet serve ARGS` with its output in `log_path`."""

    def __init__(self, args: list[str], log_path: Path, **env: str) -> None:
        self.log_path = log_path
        with log_path.open("w") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "pagefleet", "serve", *args],
                stdout=log, stderr=subprocess.STDOUT, env=subprocess_env(**env), cwd=log_path.parent,
                start_new_session=True,
            )  # fmt: skip

    @property
    def log(self) -> str:
        return self.log_path.read_text()

    def wait_serving(self, timeout_s: float = START_TIMEOUT_S) -> None:
        wait_for(lambda: self.proc.poll() is not None or "Ctrl-C to stop." in self.log,
                 timeout_s, "pagefleet serve to start", 0.5)  # fmt: skip
        assert self.proc.poll() is None, self.log[-4000:]

    def endpoint(self, label: str) -> str:
        """What the start-up banner prints after `label` (gRPC, HTTP, Ray)."""
        match = re.search(rf"^  {label} +(\S+)", self.log, re.MULTILINE)
        assert match, self.log[-4000:]
        return match.group(1)

    def processes(self) -> list[psutil.Process]:
        return session_processes(self.proc.pid)

    def stop(self, sig: signal.Signals, timeout_s: float = 120.0) -> int:
        self.proc.send_signal(sig)
        return self.wait_exit(timeout_s)

    def wait_exit(self, timeout_s: float) -> int:
        try:
            return self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"serve still running after {timeout_s}s:\n{self.log[-4000:]}") from None

    def assert_nothing_left(self, timeout_s: float = 10.0) -> None:
        """No process of the server's session runs (Ray's agents included)."""
        deadline = time.monotonic() + timeout_s
        while (left := self.processes()) and time.monotonic() < deadline:
            time.sleep(0.2)
        names = [f"{p.pid} {p.name()}" for p in left]
        assert not names, f"left running after the stop: {names}"

    def error_lines(self) -> list[str]:
        return [line for line in self.log.splitlines() if line.startswith("pagefleet serve: error:")]

    def close(self) -> None:
        """Kill whatever of the server still runs (after a failed test)."""
        kill_session(self.proc.pid)
        self.proc.wait(timeout=30)


@contextmanager
def serving(args: list[str], log_path: Path, **env: str) -> Iterator[ServeProcess]:
    """A started `pagefleet serve`; killed (its whole session) on the way out if still running."""
    server = ServeProcess(args, log_path, **env)
    try:
        yield server
    finally:
        server.close()


@contextmanager
def other_ray_head() -> Iterator[str]:
    """A separate `ray start --head` (its own port and temp dir, so its address file is
    not where a bare `ray.init()` would look); yields its address once `ray start` says
    the runtime started (its raylet registered: the GCS port answers before that), and
    kills it by session. A start whose raylet died waiting for its dashboard agent (Ray
    gives the agent 15 s, which a loaded machine can miss) is tried once more."""
    port, head = _ray_head()
    if head.poll() is not None:
        port, head = _ray_head()
    try:
        assert head.poll() is None, "the other Ray head timed out during startup twice"
        yield f"127.0.0.1:{port}"
    finally:
        head.send_signal(signal.SIGTERM)
        with suppress(subprocess.TimeoutExpired):
            head.wait(timeout=30)
        kill_session(head.pid)


def _ray_head() -> tuple[int, subprocess.Popen[bytes]]:
    """`ray start --head --block` on a free port, once it started or exited; an exit
    other than Ray's start-up timeout fails the test with its log."""
    port = free_port()
    # Short: Ray's socket paths under it must stay below the 107-byte Unix limit.
    temp_dir = tempfile.mkdtemp(prefix="pf-ray-", dir="/tmp")
    log_path = Path(temp_dir) / "ray-start.log"
    argv = ["ray", "start", "--head", "--block", f"--port={port}", "--num-cpus=1", "--num-gpus=0",
            "--include-dashboard=false", "--disable-usage-stats", f"--temp-dir={temp_dir}"]  # fmt: skip
    with log_path.open("w") as log:
        head = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=subprocess_env(),
                                start_new_session=True)  # fmt: skip
    wait_for(lambda: head.poll() is not None or "Ray runtime started." in log_path.read_text(),
             START_TIMEOUT_S, "the other Ray head to start", 0.5)  # fmt: skip
    if head.poll() is not None:
        kill_session(head.pid)  # the GCS it started outlives it
        assert "timed out during startup" in log_path.read_text(), log_path.read_text()[-3000:]
    return port, head


def write_config(path: Path, *, pool: dict[str, object] | None = None, drain_timeout_s: float = 180) -> Path:
    """A one-pool tiny-model config with its own free ports."""
    config = {
        "pools": [{"name": "default", "model": "tiny", "workers": 1, "device": "cpu", **(pool or {})}],
        "server": {"host": "127.0.0.1", "grpc_port": free_port(), "http_port": free_port(),
                   "drain_timeout_s": drain_timeout_s},
    }  # fmt: skip
    path.write_text(yaml.safe_dump(config))
    return path

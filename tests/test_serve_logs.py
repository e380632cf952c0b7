"""`pagefleet serve` logs, redirected as under systemd or CI: plain, and quiet on start and stop."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from cluster_fixtures import wait_for
from ray_nodes import free_port

REPO = Path(__file__).resolve().parent.parent

NOISE = (
    "\x1b[",  # ANSI colour codes
    "graceful_shutdown failed",
    "Connecting to existing Serve app",
    "Token authentication is enabled",
    "Traceback",
)


@pytest.mark.cluster
def test_serve_start_and_clean_stop_log_no_colours_and_no_spurious_warnings(tmp_path: Path) -> None:
    log_path = tmp_path / "serve.log"
    env = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    argv = [sys.executable, "-m", "pagefleet", "serve", "--workers", "1", "--metrics-port", "-1",
            "--grpc-port", str(free_port()), "--http-port", str(free_port())]  # fmt: skip
    with log_path.open("w") as log:
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=tmp_path)
        try:
            wait_for(
                lambda: proc.poll() is not None or "Ctrl-C to stop." in log_path.read_text(),
                300, "pagefleet serve to start", 0.5,
            )  # fmt: skip
            assert proc.poll() is None, log_path.read_text()[-3000:]
        finally:
            proc.send_signal(signal.SIGINT)
            try:
                code = proc.wait(timeout=120)
            except subprocess.TimeoutExpired:
                proc.kill()
                code = proc.wait()
    text = log_path.read_text()
    assert code == 0, text[-3000:]
    assert "pagefleet: shutting down" in text
    found = [noise for noise in NOISE if noise in text]
    assert not found, f"{found} in:\n{text[-3000:]}"

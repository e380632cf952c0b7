"""Progress bars: drawn on a real terminal (a pty), nothing when stderr is redirected."""

from __future__ import annotations

import fcntl
import io
import os
import pty
import select
import struct
import sys
import termios

import pytest

from pagefleet.worker import progress
from pagefleet.worker.model_files import CONVERSION_PHASES


def _terminal() -> tuple[int, int]:
    """A pty (master, slave) of 24 x 80 characters, as a terminal window has."""
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 80, 0, 0))
    return master, slave


def _read_all(master: int) -> bytes:
    """Everything written to the pty so far."""
    out = b""
    while select.select([master], [], [], 0.5)[0]:
        out += os.read(master, 1 << 16)
    return out


def _run_phases() -> None:
    with progress.phases("converting model.gguf", CONVERSION_PHASES) as phase:
        for name in CONVERSION_PHASES:
            phase(name)


def test_phases_draw_a_bar_naming_each_step_on_a_terminal(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TQDM_DISABLE", raising=False)
    master, slave = _terminal()
    with os.fdopen(slave, "w") as terminal:
        monkeypatch.setattr(sys, "stderr", terminal)
        assert progress.enabled()
        _run_phases()
        terminal.flush()
        drawn = _read_all(master).decode()
    os.close(master)
    assert "converting model.gguf" in drawn
    for name in CONVERSION_PHASES:
        assert name in drawn


@pytest.mark.parametrize("on_terminal", [False, True])
def test_no_bar_when_redirected_or_turned_off(monkeypatch: pytest.MonkeyPatch, on_terminal: bool) -> None:
    if on_terminal:  # a terminal, but the CLI found stderr redirected earlier and set TQDM_DISABLE
        monkeypatch.setenv("TQDM_DISABLE", "1")
        master, slave = _terminal()
        stream = os.fdopen(slave, "w")
    else:
        monkeypatch.delenv("TQDM_DISABLE", raising=False)
        stream = io.StringIO()
    monkeypatch.setattr(sys, "stderr", stream)
    assert not progress.enabled()
    _run_phases()
    stream.flush()
    if on_terminal:
        drawn = _read_all(master)
        stream.close()
        os.close(master)
    else:
        drawn = stream.getvalue().encode()
    assert drawn == b""

"""Progress bars: drawn on a real terminal (a pty), nothing when stderr is redirected."""

from __future__ import annotations

import io
import os
import pty
import sys

import pytest

from pagefleet.worker import progress
from pagefleet.worker.model_files import CONVERSION_PHASES


def _run_phases() -> None:
    with progress.phases("converting model.gguf", CONVERSION_PHASES) as phase:
        for name in CONVERSION_PHASES:
            phase(name)


def test_phases_draw_a_bar_naming_each_step_on_a_terminal(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TQDM_DISABLE", raising=False)
    master, slave = pty.openpty()
    with os.fdopen(slave, "w") as terminal:
        monkeypatch.setattr(sys, "stderr", terminal)
        assert progress.enabled()
        _run_phases()
        terminal.flush()
    drawn = os.read(master, 1 << 16).decode()
    os.close(master)
    assert "converting model.gguf" in drawn
    assert f"{len(CONVERSION_PHASES)}/{len(CONVERSION_PHASES)}" in drawn
    assert CONVERSION_PHASES[-1] in drawn


@pytest.mark.parametrize("on_terminal", [False, True])
def test_no_bar_when_redirected_or_turned_off(monkeypatch: pytest.MonkeyPatch, on_terminal: bool) -> None:
    if on_terminal:  # a terminal, but the CLI found stderr redirected earlier and set TQDM_DISABLE
        monkeypatch.setenv("TQDM_DISABLE", "1")
        master, slave = pty.openpty()
        stream = os.fdopen(slave, "w")
    else:
        monkeypatch.delenv("TQDM_DISABLE", raising=False)
        stream = io.StringIO()
    monkeypatch.setattr(sys, "stderr", stream)
    assert not progress.enabled()
    _run_phases()
    stream.flush()
    if on_terminal:
        os.set_blocking(master, False)
        try:
            drawn = os.read(master, 1 << 16)
        except BlockingIOError:
            drawn = b""
        stream.close()
        os.close(master)
    else:
        drawn = stream.getvalue().encode()
    assert drawn == b""

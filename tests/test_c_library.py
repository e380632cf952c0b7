"""The CPU kernels' C library build: once per node, under a lock, and ahead of the workers.

A real compiler builds a small C source in place of the kernels (the locking and
caching do not depend on what is compiled; `test_kernels_cpu_attention.py` builds the
real library). A wrapper on `$CC` logs each compile before handing it to `cc`.
"""

from __future__ import annotations

import ctypes
import shutil
import tempfile
import threading
from pathlib import Path

import pytest

from pagefleet import c_library

pytestmark = pytest.mark.skipif(shutil.which("cc") is None, reason="no C compiler")


@pytest.fixture
def logging_cc(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty cache root, a one-function source as the library's, and `$CC` a wrapper
    that appends one line to the returned log per compile (not per `--version`)."""
    monkeypatch.setenv("PAGEFLEET_CACHE_DIR", str(tmp_path / "cache"))
    source = tmp_path / "one.c"
    source.write_text("int pf_one(void) { return 1; }\n")
    monkeypatch.setattr(c_library, "SOURCES", (source,))
    log = tmp_path / "compiles.log"
    wrapper = tmp_path / "cc-logging"
    wrapper.write_text(
        "#!/bin/sh\n"
        f'[ "$1" = --version ] || {{ echo compile >> {log}; sleep 0.5; }}\n'
        'exec cc "$@"\n'
    )
    wrapper.chmod(0o755)
    monkeypatch.setenv("CC", str(wrapper))
    return log


def compiles(log: Path) -> int:
    return len(log.read_text().splitlines()) if log.exists() else 0


def test_processes_building_at_once_compile_once_and_share_the_build(logging_cc: Path) -> None:
    compiler = c_library.compiler()
    assert compiler is not None
    built: list[Path] = []
    threads = [
        threading.Thread(target=lambda: built.append(c_library.build(compiler))) for _ in range(3)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert len(built) == 3 and len(set(built)) == 1 and built[0].is_file()
    assert compiles(logging_cc) == 1  # the others waited on the lock, then found it built
    assert not list(built[0].parent.glob("tmp*.so"))  # no scratch file left behind


def test_a_build_ahead_leaves_the_library_built_for_the_workers(logging_cc: Path) -> None:
    thread = c_library.build_ahead()
    assert thread is not None and thread.daemon
    thread.join(timeout=60)
    assert compiles(logging_cc) == 1
    compiler = c_library.compiler()
    assert compiler is not None
    target = c_library.build(compiler)  # a worker starting afterwards
    assert target.is_file() and compiles(logging_cc) == 1


def test_a_build_ahead_that_fails_raises_nothing_and_leaves_nothing(
    logging_cc: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    bad = logging_cc.parent / "bad.c"
    bad.write_text("this is not C\n")
    monkeypatch.setattr(c_library, "SOURCES", (bad,))
    thread = c_library.build_ahead()
    assert thread is not None
    thread.join(timeout=60)
    assert compiles(logging_cc) == 1 + len(c_library.FALLBACK_FLAGS)  # every flag set tried
    assert not list((logging_cc.parent / "cache").glob("kernels/*.so"))


def test_a_cache_root_that_cannot_be_written_gives_way_to_the_temporary_directory(
    logging_cc: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    not_a_dir = logging_cc.parent / "file"
    not_a_dir.write_text("")
    monkeypatch.setenv("PAGEFLEET_CACHE_DIR", str(not_a_dir))
    monkeypatch.setattr(tempfile, "tempdir", str(logging_cc.parent / "tmp"))
    (logging_cc.parent / "tmp").mkdir()
    compiler = c_library.compiler()
    assert compiler is not None
    built = c_library.build(compiler)
    assert built.parent == logging_cc.parent / "tmp" / "pagefleet-kernels"
    assert ctypes.CDLL(str(built)).pf_one() == 1  # a library that loads
    assert compiles(logging_cc) == 1


def test_without_a_compiler_nothing_is_built_ahead(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CC", "no-such-compiler-here")
    assert c_library.compiler() is None
    assert c_library.build_ahead() is None

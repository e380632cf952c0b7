"""The CPU kernels' C library: compiled from `pagefleet/kernels/*.c` on first use, once per node.

The sources are `cpu_decode.c` (the attention kernel) and `cpu_layers.c` (the
elementwise layers), built together with the system C compiler (``$CC``, else
``cc``) into ``<cache root>/kernels/`` (`pagefleet.cache_root`). The file name
carries a digest of the sources, the flags, the compiler and the CPU, so a shared
home directory never hands one CPU's build to another. `pagefleet.kernels.cpu_decode`
loads it.

Imports the standard library only: `pagefleet serve` starts the build in the
background (`build_ahead`) before Ray or torch are imported.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

from pagefleet.cache_root import default_cache_root, file_lock

KERNELS_DIR = Path(__file__).with_name("kernels")
SOURCES = (KERNELS_DIR / "cpu_decode.c", KERNELS_DIR / "cpu_layers.c")
FLAGS = ("-O3", "-march=native", "-ffp-contract=fast", "-fPIC", "-shared", "-std=c11", "-fopenmp")
# Where the compiler has no OpenMP (Apple's clang): one thread; where it refuses
# -march=native (some Apple clang releases): the baseline ISA; then neither.
FALLBACK_FLAGS = tuple(
    tuple(f for f in FLAGS if f not in dropped)
    for dropped in (("-fopenmp",), ("-march=native",), ("-fopenmp", "-march=native"))
)


def compiler() -> str | None:
    """The C compiler (``$CC``, else ``cc``) on PATH, or None."""
    return shutil.which(os.environ.get("CC", "cc"))


def _cpu_signature() -> str:
    """The CPU model and feature flags (what -march=native builds for)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return f"{platform.machine()} {platform.processor()}"
    wanted = ("model name", "flags", "Features", "CPU part")
    lines = {}
    for line in text.splitlines():
        key = line.split(":", 1)[0].strip()
        if key in wanted and key not in lines:
            lines[key] = line
    return f"{platform.machine()} " + "\n".join(lines[k] for k in sorted(lines))


def build(compiler: str) -> Path:
    """Compile the library into the cache (under a lock: a node's processes compile it once),
    with `FLAGS`, else each of `FALLBACK_FLAGS` in turn; a cache root that cannot be written gives way
    to the temporary directory."""
    version = subprocess.run(
        [compiler, "--version"], capture_output=True, text=True, timeout=30, check=False
    ).stdout
    digest = hashlib.sha256()
    for part in (*(source.read_bytes() for source in SOURCES), " ".join(FLAGS).encode(),
                 version.encode(), _cpu_signature().encode()):  # fmt: skip
        digest.update(part)
        digest.update(b"\0")
    name = f"cpu_decode-{digest.hexdigest()[:16]}.so"
    for root in (
        default_cache_root() / "kernels",
        Path(tempfile.gettempdir()) / "pagefleet-kernels",
    ):
        target = root / name
        if target.exists():
            return target
        lock = root / f".{name}.lock"
        try:
            root.mkdir(parents=True, exist_ok=True)
            lock.touch()
        except OSError:
            continue  # not writable here
        with file_lock(lock):  # one process compiles; the node's others wait, then load its build
            return target if target.exists() else _compile(compiler, root, target)
    raise OSError(
        f"no writable directory for the kernel ({default_cache_root() / 'kernels'}, "
        f"{tempfile.gettempdir()})"
    )


def _compile(compiler: str, root: Path, target: Path) -> Path:
    """Compile into a scratch file in `root` and rename it to `target` (atomic)."""
    fd, scratch = tempfile.mkstemp(suffix=".so", dir=root)
    os.close(fd)
    try:
        errors = []
        for flags in (FLAGS, *FALLBACK_FLAGS):
            done = subprocess.run(
                [compiler, *flags, "-o", scratch, *map(str, SOURCES), "-lm"],
                capture_output=True, text=True, timeout=120, check=False,
            )  # fmt: skip
            if done.returncode == 0:
                os.replace(scratch, target)
                return target
            errors.append(f"{compiler} exited {done.returncode}: {done.stderr.strip()[-1000:]}")
        raise RuntimeError("; ".join(errors))
    finally:
        if os.path.exists(scratch):
            os.unlink(scratch)


def build_ahead() -> threading.Thread | None:
    """Start building the library in a background thread, for a process that starts CPU
    workers on this node after other work (`pagefleet serve` converting a GGUF): the
    workers then load it, or wait on the build's lock, instead of compiling after their
    own start. None where there is no compiler. A failed build is left for the workers
    to report (they fall back and log why)."""
    found = compiler()
    if found is None:
        return None

    def run() -> None:
        with contextlib.suppress(OSError, RuntimeError, subprocess.SubprocessError):
            build(found)

    thread = threading.Thread(target=run, name="pagefleet-c-library", daemon=True)
    thread.start()
    return thread

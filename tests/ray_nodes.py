"""A real multi-node Ray cluster on this machine: one `ray start` raylet per node.

`RayNodes` starts a head (`ray start --head --port P`) and adds nodes
(`ray start --address 127.0.0.1:P --node-manager-port Q`), each with its own
CPUs, GPUs (advertised: the machine needs none), custom resources and labels.
Killing a node is a SIGKILL of its raylet, found by its node-manager port,
and of every process it started: the node's processes all end at once, as
when a machine goes away.

Everything runs under a private `--temp-dir`, so `stop()` ends exactly the
processes this cluster started, by pid (never `ray stop`, which ends every Ray
on the host), and Ray's address file, which a later bare `ray.init()` would
join, is put back as it was. Token auth is off for the cluster and for the
test process that joins it (`RAY_AUTH_MODE=disabled`).

GCS fault tolerance: `redis_server()` runs a private `redis-server` (a free
port, a temp dir, nothing saved), and `RayNodes(env={"RAY_REDIS_ADDRESS":
redis.address})` starts the head on it. `kill_gcs()` SIGKILLs the head's
`gcs_server` and returns what restarts it: its command line, working directory
and environment, read from /proc before the kill (in KubeRay the head pod
restarts; here `start_gcs` starts the same process again).
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import ray

from pagefleet.cluster.gcs_watch import forget_usage_tags_of_past_rays

# Ray's address file: `ray start` writes it, a bare `ray.init()` joins what it names.
ADDRESS_FILE = Path(tempfile.gettempdir()) / "ray" / "ray_current_cluster"
# Node loss is noticed within about period x threshold (Ray's defaults: 3 s x 5).
HEALTH_CHECK = {"RAY_health_check_period_ms": "500", "RAY_health_check_failure_threshold": "4"}


# Ports the tests hand out come from below the kernel's ephemeral range (32768-60999 on
# Linux) and above Ray's worker ports (10002-19999): a port picked by binding port 0 is
# an ephemeral one, which any process's next outgoing connection may take before the
# server it was picked for binds it (a GCS restarted on its port, `start_gcs`, must
# find it free too).
TEST_PORTS = range(20000, 32768)


_handed_out: set[int] = set()


def free_port() -> int:
    """A port of TEST_PORTS free now, and never handed out before by this process: callers
    pick several before any is bound (a head's GCS, metrics and agent ports), and two of
    them drawing the same free port made `ray start` refuse to start."""
    for port in random.sample(TEST_PORTS, 200):
        if port in _handed_out:
            continue
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
        _handed_out.add(port)
        return port
    raise RuntimeError(f"no free port in {TEST_PORTS}")


@dataclass
class Node:
    """One raylet of the cluster."""

    node_manager_port: int
    labels: dict[str, str] = field(default_factory=dict)
    node_id: str = ""

    def raylet_pid(self) -> int | None:
        """The pid of this node's raylet, None once it is gone."""
        flag = f"--node_manager_port={self.node_manager_port}"
        for pid, argv in _processes():
            if argv and argv[0].endswith("/raylet") and flag in argv:
                return pid
        return None


class RayNodes:
    """A head and any number of nodes, all on 127.0.0.1; see the module docstring."""

    def __init__(self, env: dict[str, str] | None = None) -> None:
        """`env`: more environment for every `ray start` (the head's `RAY_REDIS_ADDRESS`)."""
        # Short: Ray's socket paths live under it and must stay below 108 bytes.
        self.temp_dir = tempfile.mkdtemp(prefix="pfray", dir="/tmp")
        self.port = free_port()
        self.address = f"127.0.0.1:{self.port}"
        self.env = {**os.environ, "RAY_AUTH_MODE": "disabled", **HEALTH_CHECK, **(env or {})}
        self.head: Node | None = None
        self.nodes: list[Node] = []
        self._restarted: list[subprocess.Popen[bytes]] = []  # GCS processes start_gcs started
        self._address_file = ADDRESS_FILE.read_text() if ADDRESS_FILE.exists() else None
        self._auth_mode = os.environ.get("RAY_AUTH_MODE")

    def start_head(self, *, num_cpus: float = 2, num_gpus: int = 0) -> Node:
        """The head node: it runs what asks for Ray's head-node resource (scheduler, ingress)."""
        node = Node(free_port())
        for attempt in (1, 2):
            args = (
                "--head", f"--port={self.port}", f"--num-cpus={num_cpus:g}", f"--num-gpus={num_gpus}",
                "--include-dashboard=false", f"--node-manager-port={node.node_manager_port}",
            )  # fmt: skip
            if self._ray_start(*args, last=attempt == 2):
                break
            # The first try's GCS lives on and holds its session: start over, elsewhere.
            self._kill_mine()
            self.port = free_port()
            self.address = f"127.0.0.1:{self.port}"
        self.head = node
        return node

    def add_node(
        self,
        *,
        num_cpus: float = 1,
        num_gpus: int = 0,
        labels: dict[str, str] | None = None,
        resources: dict[str, float] | None = None,
    ) -> Node:
        """Start one more raylet and return once the cluster counts it alive."""
        node = Node(free_port(), dict(labels or {}))
        args = [
            f"--address={self.address}", f"--num-cpus={num_cpus:g}", f"--num-gpus={num_gpus}",
            f"--node-manager-port={node.node_manager_port}",
        ]  # fmt: skip
        if node.labels:
            args.append("--labels=" + ",".join(f"{k}={v}" for k, v in node.labels.items()))
        if resources:
            args.append("--resources=" + json.dumps(resources))
        if not self._ray_start(*args):
            self._ray_start(*args, last=True)  # the timed-out raylet was ended: a fresh one
        self.nodes.append(node)
        if ray.is_initialized():
            self.wait_alive(node)
        return node

    def wait_alive(self, node: Node, timeout_s: float = 180.0) -> str:
        """The node's id, once the cluster lists it alive (needs `ray.init` done)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            for info in ray.nodes():
                if info["Alive"] and info["NodeManagerPort"] == node.node_manager_port:
                    node.node_id = str(info["NodeID"])
                    return node.node_id
            time.sleep(0.2)
        raise AssertionError(f"node with node-manager port {node.node_manager_port} did not join")

    def kill(self, node: Node) -> None:
        """Node loss: SIGKILL its raylet and every process it started (its workers and
        agents), at once, as when the machine goes away. (A worker process outlives a
        killed raylet for a while and could finish its streams meanwhile.)"""
        pid = node.raylet_pid()
        assert pid is not None, f"no raylet with node-manager port {node.node_manager_port}"
        for victim in [pid, *_descendants(pid)]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(victim, signal.SIGKILL)
        self.nodes.remove(node)

    def gcs_pid(self) -> int | None:
        """The pid of this cluster's `gcs_server`, None while there is none."""
        for pid, argv in _processes():
            if argv and argv[0].endswith("/gcs_server") and any(self.temp_dir in a for a in argv):
                return pid
        return None

    def kill_gcs(self) -> GcsCommand:
        """SIGKILL the head's GCS; returns how to start it again (`start_gcs`)."""
        pid = self.gcs_pid()
        assert pid is not None, "no gcs_server of this cluster runs"
        proc = Path(f"/proc/{pid}")
        argv = [a.decode() for a in (proc / "cmdline").read_bytes().split(b"\0") if a]
        environ = dict(
            entry.decode().partition("=")[::2] for entry in (proc / "environ").read_bytes().split(b"\0") if entry
        )
        command = GcsCommand(argv, os.readlink(proc / "cwd"), environ, pid)
        os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 30
        while Path(f"/proc/{pid}").exists() and _state(pid) != "Z" and time.monotonic() < deadline:
            time.sleep(0.05)
        return command

    def start_gcs(self, command: GcsCommand) -> int:
        """Start the GCS again as `kill_gcs` found it (it logs to its own files); its pid."""
        gcs = subprocess.Popen(
            command.argv, cwd=command.cwd, env=command.environ, stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
        )  # fmt: skip
        self._restarted.append(gcs)
        return gcs.pid

    def init(self, namespace: str) -> None:
        """Join the cluster from this process (without a token, as the cluster runs)."""
        self._auth_mode = os.environ.get("RAY_AUTH_MODE")
        os.environ["RAY_AUTH_MODE"] = "disabled"
        forget_usage_tags_of_past_rays()  # else this process's past local Rays' tags land here
        ray.init(address=self.address, namespace=namespace, log_to_driver=False)
        for node in [*([self.head] if self.head else []), *self.nodes]:
            self.wait_alive(node)

    def stop(self) -> None:
        """End every process of this cluster by pid; put Ray's address file back."""
        if ray.is_initialized():
            ray.shutdown()
        # Put the test process's auth mode back as it was (the suite's conftest sets it
        # for every module; dropping it would leave later local Rays on token auth).
        if self._auth_mode is None:
            os.environ.pop("RAY_AUTH_MODE", None)
        else:
            os.environ["RAY_AUTH_MODE"] = self._auth_mode
        self._kill_mine()
        for gcs in self._restarted:
            with contextlib.suppress(subprocess.TimeoutExpired):
                gcs.wait(timeout=30)  # killed above (it runs under the temp dir): reap it
        with contextlib.suppress(FileNotFoundError):
            # It names the head by its node IP: ours if it ends with our port.
            if ADDRESS_FILE.read_text().strip().endswith(f":{self.port}"):
                if self._address_file is None:
                    ADDRESS_FILE.unlink()
                else:
                    ADDRESS_FILE.write_text(self._address_file)
        shutil.rmtree(self.temp_dir, ignore_errors=True)

    def _kill_mine(self) -> None:
        """SIGKILL every process of this cluster and wait until none runs: each one whose
        command line names its temp dir (GCS, raylets, monitors) and every process below
        those. Ray's agents and workers retitle themselves (`ray::DashboardAgent`), so their
        command lines no longer name it: found by the argv alone, a node's two agents
        outlived its raylet by a minute."""
        roots = [pid for pid, argv in _processes() if any(self.temp_dir in a for a in argv)]
        victims = [*roots, *_descendants(*roots)]
        for pid in victims:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 30
        while (left := [pid for pid in victims if _state(pid) not in ("", "Z")]) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not left, f"processes of the Ray cluster under {self.temp_dir} survived SIGKILL: {left}"

    def _ray_start(self, *args: str, last: bool = False) -> bool:
        """Run `ray start`; False when its raylet did not register in time and this is not
        the `last` try. `ray start` gives a raylet 30 s (fixed), which a loaded machine
        can miss."""
        command = ["ray", "start", f"--temp-dir={self.temp_dir}", "--disable-usage-stats", *args]
        done = subprocess.run(command, env=self.env, capture_output=True, text=True, timeout=180)
        if done.returncode == 0:
            return True
        if not last and "timed out during startup" in done.stderr:
            return False
        raise RuntimeError(f"{' '.join(command)} failed:\n{done.stdout}\n{done.stderr}")


@dataclass(frozen=True)
class GcsCommand:
    """How a killed `gcs_server` ran: enough to start it again the same way."""

    argv: list[str]
    cwd: str
    environ: dict[str, str]
    pid: int  # the killed process's


@contextlib.contextmanager
def ray_nodes(env: dict[str, str] | None = None) -> Iterator[RayNodes]:
    """A `RayNodes` (see its `env`) that is stopped however the block ends."""
    nodes = RayNodes(env)
    try:
        yield nodes
    finally:
        nodes.stop()


@dataclass(frozen=True)
class Redis:
    """A running private `redis-server`."""

    address: str  # host:port, as RAY_REDIS_ADDRESS takes it
    process: subprocess.Popen[bytes]
    dir: str


@contextlib.contextmanager
def redis_server(timeout_s: float = 30.0) -> Iterator[Redis]:
    """A `redis-server` on a free port of 127.0.0.1, in a temp dir, saving nothing;
    killed (by pid) and its dir removed however the block ends."""
    assert shutil.which("redis-server"), "no redis-server: the README's test command installs it (apt)"
    port = free_port()
    work = tempfile.mkdtemp(prefix="pfredis", dir="/tmp")
    argv = ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--dir", work,
            "--save", "", "--appendonly", "no"]  # fmt: skip
    with (Path(work) / "redis.log").open("w") as log:
        process = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            assert process.poll() is None, (Path(work) / "redis.log").read_text()
            with socket.socket() as sock:
                if sock.connect_ex(("127.0.0.1", port)) == 0:
                    break
            assert time.monotonic() < deadline, f"redis-server did not listen within {timeout_s}s"
            time.sleep(0.05)
        yield Redis(f"127.0.0.1:{port}", process, work)
    finally:
        process.kill()
        process.wait(timeout=30)
        shutil.rmtree(work, ignore_errors=True)


def _processes() -> Iterator[tuple[int, list[str]]]:
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            raw = (entry / "cmdline").read_bytes()
        except OSError:
            continue
        yield int(entry.name), [a.decode(errors="replace") for a in raw.split(b"\0") if a]


def _state(pid: int) -> str:
    """The process's state letter ("Z" for a zombie), "" once it is gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]
    except (OSError, IndexError):
        return ""


def _descendants(*roots: int) -> list[int]:
    """Every process below the `roots` (children, their children, ...)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                # pid (comm) state ppid ...: comm may hold spaces, so split after it.
                ppid = int((entry / "stat").read_text().rpartition(")")[2].split()[1])
            except (OSError, ValueError, IndexError):
                continue
            children.setdefault(ppid, []).append(int(entry.name))
    found, todo = [], list(roots)
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found

"""`ray up` for real: Ray's on-premise provider over SSH to a node on this machine.

The node is this host behind fresh Linux namespaces (`unshare`, as root): its own
process space, so the `ray stop` that manifests/cluster.yaml's start commands and
`ray down` run ends the node's Ray only; its own network (loopback only), so the
manifest's fixed ports (6379, 8265, 50051, ...) are free there; its own /tmp, so Ray's
session and address files stay on the node; and a copy-on-write view of the Python
install, so the manifest's `pip install -e ~/pagefleet` changes the node's packages
only. sshd runs inside with its own config and host key, root login by a key made
here; ssh reaches it through a ProxyCommand that enters the node's network. Killing
the sshd (the node's first process) ends everything on the node, as a power-off does.

The cluster YAML is manifests/cluster.yaml with the provider, auth and node types
replaced: the same file mount, setup and start commands. The local provider takes one
node per IP and the node has the one address 127.0.0.1, so the cluster is head-only.
"""

from __future__ import annotations

import getpass
import hashlib
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import psutil
import pytest
import yaml
from cluster_fixtures import generate, pool_status, tokens_of, wait_for
from ray.autoscaler._private.command_runner import HASH_MAX_LENGTH

from pagefleet import LLM, SamplingParams

pytestmark = [pytest.mark.cluster, pytest.mark.slow, pytest.mark.timeout(600)]

REPO = Path(__file__).resolve().parent.parent
MANIFEST = REPO / "manifests" / "cluster.yaml"
SSHD = Path("/usr/sbin/sshd")
PROMPT = "Hello from a cluster that ray up started"
MAX_TOKENS = 12


@dataclass
class SshNode:
    """A node on this host that ssh reaches as root; `root / "tmp"` is its /tmp."""

    root: Path
    unshare: subprocess.Popen[bytes]
    key: Path
    proxy: Path

    def ssh_options(self) -> list[str]:
        return [
            "-i", str(self.key),
            "-o", "IdentitiesOnly=yes",
            "-o", "StrictHostKeyChecking=no",
            "-o", f"UserKnownHostsFile={os.devnull}",
            "-o", f"ProxyCommand={self.proxy}",
            "-o", "LogLevel=ERROR",
        ]  # fmt: skip

    def ssh(self, command: str, timeout_s: float = 60) -> str:
        """Run `command` on the node in a login shell (as Ray's command runner does)."""
        done = subprocess.run(
            ["ssh", *self.ssh_options(), "root@127.0.0.1", f"bash --login -c {_quote(command)}"],
            capture_output=True,
            text=True,
            timeout=timeout_s,
        )
        assert done.returncode == 0, f"{command!r} on the node: {done.stdout}{done.stderr}"
        return done.stdout

    def forward(self, node_port: int) -> tuple[subprocess.Popen[bytes], int]:
        """Forward a free local port to `node_port` on the node's loopback (ssh -L)."""
        local_port = _free_port()
        tunnel = subprocess.Popen(
            ["ssh", *self.ssh_options(), "-N", "-o", "ExitOnForwardFailure=yes",
             "-L", f"127.0.0.1:{local_port}:127.0.0.1:{node_port}", "root@127.0.0.1"],
        )  # fmt: skip
        wait_for(lambda: _accepts(local_port), 30, f"ssh -L {local_port}:{node_port} up")
        return tunnel, local_port

    def ray_processes(self) -> list[str]:
        """Command lines of the node's Ray processes (its GCS, raylet, dashboard...)."""
        init = psutil.Process(self.unshare.pid).children()[0]
        names = ("gcs_server", "raylet", "dashboard", "ray::")
        return [
            " ".join(p.cmdline())
            for p in init.children(recursive=True)
            if any(n in " ".join(p.cmdline()) for n in names)
        ]


def _quote(command: str) -> str:
    return "'" + command.replace("'", "'\\''") + "'"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _accepts(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


def _node_init_script(root: Path) -> str:
    """What the node runs first: its loopback, its own /run, /tmp and Python install."""
    prefix = Path(sys.prefix)
    return f"""set -e
ip link set lo up
mount -t tmpfs tmpfs {root}/overlay
mkdir {root}/overlay/upper {root}/overlay/work
mount -t overlay overlay -o lowerdir={prefix},upperdir={root}/overlay/upper,workdir={root}/overlay/work {prefix}
mount -t tmpfs tmpfs /run
mkdir /run/sshd
mount --bind {root}/tmp /tmp
exec {SSHD} -f /tmp/sshd/sshd_config -D -e
"""


def _node_environment() -> str:
    """The node's ~/.bashrc: Python on PATH, offline model loading, pip from what is
    installed (the node has no network)."""
    return f"""export PATH={Path(sys.executable).parent}:$PATH
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 RAY_USAGE_STATS_ENABLED=0
# A raylet waits this long for its agents' ports (30 s by default): a busy machine starts
# their Python processes slowly.
export RAY_agent_register_timeout_ms=120000
# ... and `ray start` for its raylet to register with the GCS
export RAY_raylet_start_wait_time_s=120
# pip's env form of --no-index, --no-deps and --no-build-isolation (that one reads
# inverted): the dependencies and the build backend come with the node's Python
export PIP_NO_INDEX=1 PIP_NO_DEPS=1 PIP_NO_BUILD_ISOLATION=0
"""


def start_ssh_node() -> SshNode:
    missing = [
        tool for tool in (str(SSHD), "rsync", "unshare", "nsenter") if not shutil.which(tool)
    ]
    assert not missing, f"`ray up` over SSH needs {missing}: apt-get install openssh-server rsync"
    assert os.geteuid() == 0, "the node's namespaces and sshd's root login need root"
    # Short: Ray's socket paths under the node's /tmp must fit the 107-byte limit anyway,
    # and ssh's ControlPath lives under the host's /tmp.
    root = Path(tempfile.mkdtemp(prefix="pf-ray-up-"))
    root.chmod(0o755)
    for d in ("tmp/sshd", "tmp/home", "overlay", "host_tmp"):
        (root / d).mkdir(parents=True)
    key = root / "client_key"
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(key)], check=True)
    subprocess.run(
        ["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(root / "tmp/sshd/host_key")],
        check=True,
    )
    shutil.copy(root / "client_key.pub", root / "tmp/sshd/authorized_keys")
    (root / "tmp/sshd/sshd_config").write_text(
        "ListenAddress 127.0.0.1:22\n"
        "HostKey /tmp/sshd/host_key\n"
        "AuthorizedKeysFile /tmp/sshd/authorized_keys\n"
        "PermitRootLogin prohibit-password\n"
        "PasswordAuthentication no\n"
        "KbdInteractiveAuthentication no\n"
        "UsePAM no\n"
        "StrictModes no\n"  # its files sit under /tmp, which is world-writable
        "PidFile none\n"
        "PrintMotd no\n"
        "SetEnv HOME=/tmp/home\n"
    )
    (root / "tmp/home/.bashrc").write_text(_node_environment())
    (root / "tmp/home/.profile").write_text(". ~/.bashrc\n")  # login shells, as on Debian
    (root / "init.sh").write_text(_node_init_script(root))
    log = open(root / "sshd.log", "wb")  # noqa: SIM115 - sshd writes it as long as it runs
    unshare = subprocess.Popen(
        ["unshare", "--pid", "--fork", "--mount-proc", "--net", "--mount", "--kill-child",
         "bash", str(root / "init.sh")],
        stdout=log, stderr=subprocess.STDOUT,
    )  # fmt: skip
    log.close()
    wait_for(
        lambda: (
            b"Server listening" in (root / "sshd.log").read_bytes() or unshare.poll() is not None
        ),
        30,
        "the node's sshd listening",
    )
    assert unshare.poll() is None, f"the node did not start: {(root / 'sshd.log').read_text()}"
    init_pid = psutil.Process(unshare.pid).children()[0].pid
    proxy = root / "proxy"
    # Into the node's network, then a byte pipe to its sshd (bash's /dev/tcp).
    proxy.write_text(
        "#!/bin/bash\n"
        f"exec nsenter --net=/proc/{init_pid}/ns/net -- "
        "bash -c 'exec 3<>/dev/tcp/127.0.0.1/22; cat <&3 & cat >&3'\n"
    )
    proxy.chmod(0o755)
    return SshNode(root, unshare, key, proxy)


def stop_ssh_node(node: SshNode) -> None:
    node.unshare.kill()  # --kill-child: its child, the node's first process, goes with it
    node.unshare.wait(timeout=30)
    shutil.rmtree(node.root, ignore_errors=True)


def on_premise_cluster_config(node: SshNode, cluster_name: str) -> dict[str, Any]:
    """manifests/cluster.yaml on Ray's local provider: its file mounts, setup and start
    commands as they are; the provider, the SSH login and the node types replaced."""
    config = dict(yaml.safe_load(MANIFEST.read_text()))
    # The local provider brings its own single node type, one node per listed IP.
    for cloud_only in ("available_node_types", "head_node_type", "max_workers"):
        del config[cloud_only]
    config["cluster_name"] = cluster_name
    config["provider"] = {"type": "local", "head_ip": "127.0.0.1", "worker_ips": []}
    config["auth"] = {
        "ssh_user": "root",
        "ssh_private_key": str(node.key),
        "ssh_proxy_command": str(node.proxy),
    }
    return config


def _ssh_control_path(cluster_name: str) -> Path:
    """Where Ray's SSH command runner keeps this cluster's shared ssh connections."""
    user = hashlib.sha256(getpass.getuser().encode()).hexdigest()[:HASH_MAX_LENGTH]
    return (
        Path("/tmp")
        / f"ray_ssh_{user}"
        / hashlib.sha256(cluster_name.encode()).hexdigest()[:HASH_MAX_LENGTH]
    )


@dataclass
class RayUpCluster:
    node: SshNode
    config: Path
    env: dict[str, str]

    def ray(self, *args: str, timeout_s: float = 300) -> str:
        """Run a `ray` cluster-launcher command on this cluster from the repository root;
        its output, also kept in the node's folder (`ray-<n>.log`)."""
        log = self.node.root / f"ray-{len(list(self.node.root.glob('ray-*.log')))}.log"
        with open(log, "w") as out:
            try:
                rc = subprocess.run(
                    ["ray", *args], cwd=REPO, env=self.env, stdout=out, stderr=subprocess.STDOUT,
                    timeout=timeout_s, check=False,
                ).returncode  # fmt: skip
            except subprocess.TimeoutExpired:
                rc = None
        output = log.read_text()
        assert rc == 0, (
            f"ray {' '.join(args)}: exit {rc} (None: over {timeout_s}s): {output[-6000:]}"
        )
        return output


@pytest.fixture(scope="module")
def cluster() -> Iterator[RayUpCluster]:
    node = start_ssh_node()
    cluster_name = f"pagefleet-ray-up-{uuid.uuid4().hex[:8]}"
    try:
        config = node.root / "cluster.yaml"
        config.write_text(yaml.safe_dump(on_premise_cluster_config(node, cluster_name)))
        # The launcher's own state (the local provider's node list, its config cache)
        # goes to TMPDIR: keep it with the node.
        env = {**os.environ, "TMPDIR": str(node.root / "host_tmp")}
        env.pop("PYTHONPATH", None)
        running = RayUpCluster(node, config, env)
        started = time.monotonic()
        running.ray("up", "-y", "--no-config-cache", str(config))
        print(f"ray up: {time.monotonic() - started:.1f}s")
        yield running
    finally:
        stop_ssh_node(node)
        shutil.rmtree(_ssh_control_path(cluster_name), ignore_errors=True)


def test_ray_up_installs_the_mounted_checkout_on_the_head(cluster: RayUpCluster) -> None:
    where = cluster.ray(
        "exec", str(cluster.config), "python -c 'import pagefleet; print(pagefleet.__file__)'"
    )
    assert "/tmp/home/pagefleet/pagefleet/__init__.py" in where


def test_ray_status_on_the_head_lists_it_as_the_local_providers_node(cluster: RayUpCluster) -> None:
    report = cluster.ray("exec", str(cluster.config), "ray status")
    # Active or idle, the head is one node of the local provider's one node type.
    assert "\n 1 local.cluster.node" in report, report


def test_serve_deploy_of_the_manifest_serves_a_generate_request(cluster: RayUpCluster) -> None:
    cluster.ray("exec", str(cluster.config), "serve deploy ~/pagefleet/manifests/serve.yaml")
    tunnel, port = cluster.node.forward(50051)  # serve.yaml's gRPC port, on the node
    try:
        target = f"127.0.0.1:{port}"
        # The ingress opens its port once every worker has loaded the model.
        deadline = time.monotonic() + 300
        while not _answers(target):
            if time.monotonic() > deadline:
                raise AssertionError(
                    f"pagefleet not serving after 300 s:\n{_serve_status(cluster)}"
                )
            time.sleep(1.0)
        got = generate(target, PROMPT, max_tokens=MAX_TOKENS, ignore_eos=True)
        want = LLM(model="tiny", block_size=16).generate(
            [PROMPT], SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)
        )
        assert tokens_of(got) == want[0].token_ids
        assert got[-1].finish_reason == "length"
        wait_for(
            lambda: _no_block_leaked(target), 30, "no live block and free + cached == total", 0.5
        )
    finally:
        tunnel.kill()
        tunnel.wait()


def _serve_status(cluster: RayUpCluster) -> str:
    return cluster.node.ssh(
        "serve status 2>&1; tail -n 40 /tmp/ray/session_latest/logs/serve/*.log"
    )


def _answers(target: str) -> bool:
    try:
        workers = pool_status(target).workers
    except grpc.RpcError:
        return False
    return len(workers) == 2 and all(w.alive for w in workers)  # serve.yaml's pool


def _no_block_leaked(target: str) -> bool:
    return all(
        w.live_blocks == 0 and w.free_blocks + w.cached_blocks == w.total_blocks
        for w in pool_status(target).workers
    )


def test_ray_down_stops_ray_on_the_node(cluster: RayUpCluster) -> None:
    assert cluster.node.ray_processes(), "no Ray on the node before ray down"
    cluster.ray("down", "-y", str(cluster.config))
    wait_for(lambda: not cluster.node.ray_processes(), 30, "no Ray process left on the node", 0.5)

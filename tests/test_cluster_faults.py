"""Hostile clients against a real two-tenant cluster over TLS (issue 10's findings).

One cluster for the module, started as operators do: a `pagefleet serve`
process. Pool "default" (1 worker) is shared by tenants acme and beta, pool
"other" (1 worker) is tenant gamma's; gRPC and HTTP serve TLS with a
self-signed certificate made here; body, message and timeout limits are small
so the limit tests stay quick. Every test leaves each worker with no live
block and free + cached == total, and the same worker process it found (no
request may kill a worker). The drain test runs last: it sends SIGTERM to the
`serve` process, which drains and exits.
"""

from __future__ import annotations

import concurrent.futures
import datetime
import ipaddress
import json
import os
import re
import signal
import socket
import ssl
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import httpx
import pytest
import ray
import yaml
from cluster_fixtures import wait_for
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID
from grpc_health.v1 import health_pb2, health_pb2_grpc
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pagefleet.cluster.app import NAMESPACE
from pagefleet.cluster.client import auth_metadata, build_request, get_status, stream_generate
from pagefleet.cluster.config import ClusterConfig
from pagefleet.cluster.proto import pagefleet_pb2 as pb
from pagefleet.cluster.proto import pagefleet_pb2_grpc as pb_grpc

pytestmark = [pytest.mark.cluster, pytest.mark.slow, pytest.mark.timeout(600)]

KEY_ACME, KEY_BETA, KEY_GAMMA = "sk-acme-faults-0123456789abcdef", "sk-beta-faults-0123456789abcdef", "sk-gamma-faults-0123456789abcdef"
MAX_MODEL_LEN = 160
LONG_MODEL_LEN = 2048
DRAIN_TIMEOUT_S = 4.0  # the short streams (60 tokens) end well within it, the long one (2,000) never
LIMIT_BYTES = 64 * 1024  # max_message_bytes and max_body_bytes of this cluster
TIMEOUT_S = 1.5  # header, body and idle timeouts of this cluster
PROMPT = "The quick brown fox"
TLS_NAME = "localhost"


# ----- the cluster ------------------------------------------------------------------


def _self_signed(directory: Path) -> tuple[Path, Path]:
    """A certificate for localhost / 127.0.0.1 and its key, as PEM files."""
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, TLS_NAME)])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(
            x509.SubjectAlternativeName(
                [x509.DNSName(TLS_NAME), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
            ),
            critical=False,
        )
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    cert_file, key_file = directory / "cert.pem", directory / "key.pem"
    cert_file.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_file.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    return cert_file, key_file


@pytest.fixture(scope="module")
def cert(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    return _self_signed(tmp_path_factory.mktemp("tls"))


def faults_config(cert_file: Path, key_file: Path) -> dict[str, Any]:
    pool = {
        "model": "tiny",
        "workers": 1,
        "block_size": 4,
        "num_kv_blocks": 128,
        "max_model_len": MAX_MODEL_LEN,
        "max_num_seqs": 4,
        "max_num_batched_tokens": 256,
        "device": "cpu",
    }
    return (
        {
            "pools": [
                {"name": "default", **pool},
                # Room for a stream that outlasts the drain timeout.
                {"name": "other", **pool, "max_model_len": LONG_MODEL_LEN, "num_kv_blocks": 520},
            ],
            "tenants": [
                {"name": "acme", "pool": "default", "api_key": KEY_ACME},
                {"name": "beta", "pool": "default", "api_key": KEY_BETA},
                {"name": "gamma", "pool": "other", "api_key": KEY_GAMMA},
            ],
            "scheduler": {"report_interval_s": 0.2, "report_timeout_s": 2.0, "wait_queue_size": 32},
            "server": {
                # Public fronts; /metrics must still stay on localhost (metrics_host).
                "host": "0.0.0.0",
                "grpc_port": 0,
                "http_port": 0,
                "max_message_bytes": LIMIT_BYTES,
                "max_body_bytes": LIMIT_BYTES,
                "header_timeout_s": TIMEOUT_S,
                "body_timeout_s": TIMEOUT_S,
                "idle_timeout_s": TIMEOUT_S,
                "drain_timeout_s": DRAIN_TIMEOUT_S,
                "tls_cert_file": str(cert_file),
                "tls_key_file": str(key_file),
            },
        }
    )


@dataclass
class Served:
    """A running `pagefleet serve` process, its ports and its worker actors."""

    process: subprocess.Popen[str]
    grpc_port: int
    http_port: int
    metrics_port: int
    log: Path

    @property
    def grpc_target(self) -> str:
        return f"127.0.0.1:{self.grpc_port}"


def _wait_for_ports(process: subprocess.Popen[str], log: Path, timeout_s: float) -> dict[str, str]:
    patterns = {
        "ray": r"Ray +(\S+:\d+)",
        "grpc": r"gRPC +[\d.]+:(\d+)",
        "http": r"HTTP +https://[\d.]+:(\d+)",
        "metrics": r"metrics +http://127\.0\.0\.1:(\d+)",
    }
    deadline = time.monotonic() + timeout_s
    while True:
        text = log.read_text()
        if "Ctrl-C to stop." in text:
            ports = {}
            for name, pattern in patterns.items():
                match = re.search(pattern, text)
                assert match is not None, f"no {name} port in the serve output:\n{text}"
                ports[name] = match.group(1)
            return ports
        if process.poll() is not None or time.monotonic() > deadline:
            raise AssertionError(f"pagefleet serve did not start (rc={process.poll()}):\n{text}")
        time.sleep(0.2)


@pytest.fixture(scope="module")
def cluster(cert: tuple[Path, Path], tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    work = tmp_path_factory.mktemp("serve")
    config_file, log = work / "cluster.yaml", work / "serve.log"
    config = faults_config(*cert)
    ClusterConfig.from_dict(config)  # a bad config fails here, with its message
    config_file.write_text(yaml.safe_dump(config))
    command = [
        sys.executable, "-m", "pagefleet", "serve", "--config", str(config_file),
        "--grpc-port", "0", "--http-port", "0", "--metrics-port", "0",
    ]
    # This process joins the serve process's Ray cluster (to read its workers): no token.
    env = {**os.environ, "RAY_AUTH_MODE": "disabled"}
    with log.open("w") as out:
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, text=True, env=env)
    try:
        ports = _wait_for_ports(process, log, timeout_s=400)
        # The test process joins the serve process's Ray cluster to read its workers.
        with pytest.MonkeyPatch.context() as patch:
            patch.setenv("RAY_AUTH_MODE", "disabled")
            ray.init(address=ports["ray"], namespace=NAMESPACE, log_to_driver=False)
        yield Served(process, int(ports["grpc"]), int(ports["http"]), int(ports["metrics"]), log)
    finally:
        if ray.is_initialized():
            ray.shutdown()
        if process.poll() is None:
            process.send_signal(signal.SIGINT)  # a second signal stops at once
            process.send_signal(signal.SIGINT)
            try:
                process.wait(120)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(30)


@pytest.fixture(scope="module")
def channel(cluster: Served, cert: tuple[Path, Path]) -> Iterator[grpc.Channel]:
    creds = grpc.ssl_channel_credentials(root_certificates=cert[0].read_bytes())
    options = [("grpc.ssl_target_name_override", TLS_NAME), ("grpc.max_send_message_length", 2**24)]
    with grpc.secure_channel(cluster.grpc_target, creds, options=options) as ch:
        yield ch


@pytest.fixture(scope="module")
def grpc_stub(channel: grpc.Channel) -> pb_grpc.GenerationStub:
    return pb_grpc.GenerationStub(channel)


@pytest.fixture(scope="module")
def https_url(cluster: Served) -> str:
    return f"https://{TLS_NAME}:{cluster.http_port}"


@pytest.fixture(scope="module")
def tls_context(cert: tuple[Path, Path]) -> ssl.SSLContext:
    return ssl.create_default_context(cafile=str(cert[0]))


def _client(https_url: str, tls_context: ssl.SSLContext, key: str = KEY_ACME) -> httpx.Client:
    # No keep-alive: this cluster closes idle connections after TIMEOUT_S.
    return httpx.Client(
        base_url=https_url,
        verify=tls_context,
        headers={"Authorization": f"Bearer {key}"},
        timeout=120,
        limits=httpx.Limits(max_keepalive_connections=0),
    )


@pytest.fixture(scope="module")
def http(https_url: str, tls_context: ssl.SSLContext) -> Iterator[httpx.Client]:
    with _client(https_url, tls_context) as client:
        yield client


WORKER_NAMES = ("pagefleet-worker-default-0", "pagefleet-worker-other-0")


def _workers(cluster: Served) -> list[Any]:
    return [ray.get_actor(name, namespace=NAMESPACE) for name in WORKER_NAMES]


@pytest.fixture(scope="module")
def worker_pids(cluster: Served) -> list[int]:
    return [ray.get(h.info.remote(), timeout=60)["pid"] for h in _workers(cluster)]


@pytest.fixture(autouse=True)
def no_worker_hurt(cluster: Served, worker_pids: list[int]) -> Iterator[None]:
    """After each test: the same worker processes, no live block, free + cached == total."""
    yield
    if cluster.process.poll() is not None:
        return  # the drain test stopped the cluster

    def clean() -> bool:
        for handle in _workers(cluster):
            s = ray.get(handle.stats.remote(), timeout=30)
            if s.live != 0 or s.free + s.cached != s.total:
                return False
        return True

    wait_for(clean, 30, "every worker with free + cached == total and no live blocks")
    pids = [ray.get(h.info.remote(), timeout=30)["pid"] for h in _workers(cluster)]
    assert pids == worker_pids, "a worker process died (Ray restarted it)"
    for handle in _workers(cluster):
        ray.get(handle.check_integrity.remote(), timeout=30)


def _generate(
    stub: pb_grpc.GenerationStub, prompt: str | list[int], key: str = KEY_ACME, *, request_id: str = "",
    pool: str = "", **sampling: Any,
) -> list[pb.GenerateResponse]:
    req = build_request(prompt, sampling, request_id=request_id, pool=pool)
    return list(stub.Generate(req, timeout=120, metadata=auth_metadata(key)))


def _tokens(messages: list[pb.GenerateResponse]) -> list[int]:
    return [t for m in messages for t in m.token_ids]


def _grpc_error(call: Any) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as err:
        call()
    return err.value


def _error(r: httpx.Response, status: int) -> str:
    assert r.status_code == status, r.text
    return str(r.json()["error"]["message"])


# ----- finding 1: a poison value fails nobody else ------------------------------------


def test_tiny_temperatures_are_greedy_and_every_other_stream_finishes(
    grpc_stub: pb_grpc.GenerationStub, http: httpx.Client
) -> None:
    want = _tokens(_generate(grpc_stub, PROMPT, max_tokens=12))

    def bystander(i: int) -> list[pb.GenerateResponse]:
        return _generate(grpc_stub, f"{PROMPT} {i}", KEY_BETA, max_tokens=24, temperature=0.8, seed=i)

    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        others = [pool.submit(bystander, i) for i in range(2)]
        poison_grpc = pool.submit(_generate, grpc_stub, PROMPT, max_tokens=12, temperature=1e-39)
        poison_http = pool.submit(
            http.post, "/v1/completions",
            json={"model": "default", "prompt": PROMPT, "max_tokens": 12, "temperature": 1e-300},
        )
        assert _tokens(poison_grpc.result()) == want
        r = poison_http.result()
        assert r.status_code == 200, r.text
        for fut in others:
            assert fut.result()[-1].finish_reason in ("length", "stop")
    assert r.json()["choices"][0]["text"] == "".join(m.text for m in _generate(grpc_stub, PROMPT, max_tokens=12))


def test_sampling_values_the_sampler_cannot_compute_are_invalid_argument(
    grpc_stub: pb_grpc.GenerationStub, http: httpx.Client
) -> None:
    err = _grpc_error(lambda: _generate(grpc_stub, PROMPT, temperature=float("inf")))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "temperature must be >= 0 and finite" in (err.details() or "")
    body = {"prompt": PROMPT, "stop": ["x"] * 17}
    assert "at most 16 stop strings" in _error(http.post("/v1/completions", json=body), 400)


# ----- findings 2 and 3: tenants see only their own -------------------------------------


def test_two_tenants_may_use_the_same_request_id_at_once(grpc_stub: pb_grpc.GenerationStub) -> None:
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        runs = [
            pool.submit(_generate, grpc_stub, PROMPT, key, request_id="shared-id", max_tokens=40, ignore_eos=True)
            for key in (KEY_ACME, KEY_BETA)
        ]
        for run in runs:
            messages = run.result()
            assert messages[-1].finish_reason == "length"
            assert {m.request_id for m in messages} == {"shared-id"}


def test_abort_of_another_tenants_request_is_not_found_and_leaves_it_running(
    grpc_stub: pb_grpc.GenerationStub,
) -> None:
    req = build_request(PROMPT, {"max_tokens": 100, "ignore_eos": True}, request_id="acme-only")
    stream = grpc_stub.Generate(req, timeout=120, metadata=auth_metadata(KEY_ACME))
    first = next(stream)
    found = grpc_stub.Abort(pb.AbortRequest(request_id="acme-only"), metadata=auth_metadata(KEY_BETA))
    rest = list(stream)
    assert not found.found
    assert rest[-1].finish_reason == "length"
    assert len(_tokens([first, *rest])) == 100


def test_status_shows_a_tenant_only_its_own_pool(grpc_stub: pb_grpc.GenerationStub) -> None:
    pools = grpc_stub.GetStatus(pb.StatusRequest(), metadata=auth_metadata(KEY_GAMMA)).pools
    assert [p.name for p in pools] == ["other"]


def test_another_tenants_pool_answers_exactly_like_an_unknown_one(
    grpc_stub: pb_grpc.GenerationStub, http: httpx.Client
) -> None:
    def status_error(pool: str) -> grpc.RpcError:
        return _grpc_error(
            lambda: grpc_stub.GetStatus(pb.StatusRequest(pool=pool), metadata=auth_metadata(KEY_ACME))
        )

    def generate_error(pool: str) -> grpc.RpcError:
        return _grpc_error(lambda: _generate(grpc_stub, PROMPT, pool=pool))

    for call in (status_error, generate_error):
        forbidden, unknown = call("other"), call("zzzzz")
        assert forbidden.code() == unknown.code() == grpc.StatusCode.NOT_FOUND
        assert (forbidden.details() or "").replace("'other'", "'zzzzz'") == unknown.details()
    forbidden_http = http.post("/v1/completions", json={"model": "other", "prompt": PROMPT})
    unknown_http = http.post("/v1/completions", json={"model": "zzzzz", "prompt": PROMPT})
    assert _error(forbidden_http, 404).replace("'other'", "'zzzzz'") == _error(unknown_http, 404)


def _listen_addresses(port: int) -> set[str]:
    """Local IPv4 addresses (hex, as in /proc/net/tcp) with a socket listening on `port`."""
    found = set()
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        local, state = line.split()[1], line.split()[3]
        address, hex_port = local.split(":")
        if state == "0A" and int(hex_port, 16) == port:
            found.add(address)
    return found


def test_metrics_listen_on_localhost_only(cluster: Served) -> None:
    assert cluster.metrics_port is not None
    assert _listen_addresses(cluster.metrics_port) == {"0100007F"}  # 127.0.0.1


# ----- finding 4: limits before work ----------------------------------------------------


def test_a_prompt_longer_than_max_model_len_can_hold_is_refused_naming_the_limit(
    grpc_stub: pb_grpc.GenerationStub,
) -> None:
    err = _grpc_error(lambda: _generate(grpc_stub, "word " * 10_000))  # 50 kB, under the message limit
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "characters cannot fit" in (err.details() or "")


def test_a_grpc_message_over_max_message_bytes_is_resource_exhausted(
    grpc_stub: pb_grpc.GenerationStub,
) -> None:
    err = _grpc_error(lambda: _generate(grpc_stub, "x" * (LIMIT_BYTES + 1)))
    assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED


def test_an_http_body_over_max_body_bytes_is_413(http: httpx.Client) -> None:
    r = http.post("/v1/completions", json={"prompt": "x" * (LIMIT_BYTES + 1)})
    assert f"max_body_bytes {LIMIT_BYTES}" in _error(r, 413)


def test_a_long_request_id_is_invalid_argument(grpc_stub: pb_grpc.GenerationStub) -> None:
    err = _grpc_error(lambda: _generate(grpc_stub, PROMPT, request_id="r" * 10_000))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "at most 256 characters" in (err.details() or "")


def _tls_socket(cluster: Served, tls_context: ssl.SSLContext) -> ssl.SSLSocket:
    raw = socket.create_connection(("127.0.0.1", cluster.http_port or 0), timeout=30)
    return tls_context.wrap_socket(raw, server_hostname=TLS_NAME)


def _read_until_closed(sock: ssl.SSLSocket) -> bytes:
    data = b""
    try:
        while chunk := sock.recv(65536):
            data += chunk
    except (ConnectionResetError, ssl.SSLError):
        pass
    return data


def test_a_connection_that_never_finishes_its_headers_is_closed(
    cluster: Served, tls_context: ssl.SSLContext
) -> None:
    with _tls_socket(cluster, tls_context) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")  # and then nothing
        assert _read_until_closed(sock) == b""


def test_a_body_that_never_arrives_is_408(cluster: Served, tls_context: ssl.SSLContext) -> None:
    with _tls_socket(cluster, tls_context) as sock:
        sock.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
            + f"Authorization: Bearer {KEY_ACME}\r\n".encode()
            + b"Content-Type: application/json\r\nContent-Length: 100\r\n\r\n{\"prompt\""
        )
        assert _read_until_closed(sock).startswith(b"HTTP/1.1 408")


def test_a_connection_that_sends_nothing_is_closed(
    cluster: Served, tls_context: ssl.SSLContext
) -> None:
    with _tls_socket(cluster, tls_context) as sock:  # handshake done, then silence
        assert _read_until_closed(sock) == b""  # closed by the server, before our 30 s timeout


# ----- finding 7: the right codes -------------------------------------------------------


@pytest.mark.parametrize(
    ("body", "reason"),
    [
        (b"[" * 5000 + b"]" * 5000, "nested too deeply"),
        (b'{"prompt": "bad \\ud800 text"}', "not valid Unicode"),
        (b'{"prompt": "\xff\xfe"}', "not valid JSON"),
        (b'{"prompt": {"a": 1}}', "prompt must be a string or a list of token ids"),
        (b'{"prompt": "hi", "max_tokens": "9"}', "max_tokens must be"),
        (b'{"prompt": "hi", "temperature": 1e999}', "temperature must be >= 0 and finite"),
        (b'{"prompt": [1, 99999999999999999999]}', "outside [0, 2147483648)"),
    ],
)
def test_malformed_http_bodies_are_400_with_the_reason(http: httpx.Client, body: bytes, reason: str) -> None:
    r = http.post("/v1/completions", content=body, headers={"content-type": "application/json"})
    assert reason in _error(r, 400)


def test_undecodable_grpc_bytes_are_invalid_argument(channel: grpc.Channel) -> None:
    call = channel.unary_stream(
        "/pagefleet.v1.Generation/Generate", request_serializer=None, response_deserializer=None
    )
    bad_utf8 = b"\x12\x02\xff\xfe"  # field 2 (prompt), two bytes that are not UTF-8
    err = _grpc_error(lambda: list(call(bad_utf8, timeout=30, metadata=auth_metadata(KEY_ACME))))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "UTF-8" in (err.details() or "")


def test_the_python_client_speaks_tls_with_the_ca_file(
    cluster: Served, cert: tuple[Path, Path], grpc_stub: pb_grpc.GenerationStub
) -> None:
    target = f"{TLS_NAME}:{cluster.grpc_port}"
    ca = str(cert[0])
    got = list(stream_generate(target, PROMPT, {"max_tokens": 6}, api_key=KEY_ACME, tls_ca=ca))
    assert _tokens(got) == _tokens(_generate(grpc_stub, PROMPT, max_tokens=6))
    assert [p.name for p in get_status(target, api_key=KEY_BETA, tls_ca=ca).pools] == ["default"]


def test_a_plaintext_client_gets_no_answer_from_the_tls_server(cluster: Served) -> None:
    with pytest.raises(httpx.HTTPError):
        httpx.get(f"http://127.0.0.1:{cluster.http_port}/health", timeout=10)


# ----- fuzz: generated requests never hurt the server -----------------------------------

_GRPC_OK = {
    grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
}
_FUZZ = settings(
    max_examples=25, deadline=None, derandomize=True,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
_floats = st.floats(allow_nan=True, allow_infinity=True, width=32)
_sampling = st.builds(
    pb.SamplingParams,
    max_tokens=st.integers(-(2**31), 2**31 - 1) | st.integers(0, 8),
    temperature=_floats,
    top_p=_floats,
    top_k=st.integers(-(2**31), 2**31 - 1),
    stop=st.lists(st.text(max_size=300), max_size=20),
    stop_token_ids=st.lists(st.integers(-(2**31), 2**31 - 1), max_size=70),
    ignore_eos=st.booleans(),
)
_grpc_requests = st.builds(
    pb.GenerateRequest,
    request_id=st.text(max_size=300),
    prompt=st.text(max_size=200),
    prompt_token_ids=st.lists(st.integers(-(2**31), 2**31 - 1), max_size=20),
    sampling=_sampling,
    priority=st.integers(-(2**31), 2**31 - 1),
    pool=st.sampled_from(["", "default", "other", "nope"]),
)


def _code(call: Any) -> grpc.StatusCode:
    try:
        call()
    except grpc.RpcError as exc:
        return exc.code()
    return grpc.StatusCode.OK


@_FUZZ
@given(req=_grpc_requests)
def test_fuzzed_grpc_requests_get_a_client_status_code(
    grpc_stub: pb_grpc.GenerationStub, req: pb.GenerateRequest
) -> None:
    code = _code(lambda: list(grpc_stub.Generate(req, timeout=120, metadata=auth_metadata(KEY_ACME))))
    assert code in _GRPC_OK


@_FUZZ
@given(data=st.binary(max_size=400))
def test_fuzzed_grpc_bytes_get_a_client_status_code(channel: grpc.Channel, data: bytes) -> None:
    call = channel.unary_stream(
        "/pagefleet.v1.Generation/Generate", request_serializer=None, response_deserializer=None
    )
    assert _code(lambda: list(call(data, timeout=120, metadata=auth_metadata(KEY_BETA)))) in _GRPC_OK


_json = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=40),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=12), inner, max_size=4),
    max_leaves=12,
)
_bodies = st.fixed_dictionaries(
    {"prompt": st.text(max_size=80) | st.lists(st.integers(-5, 2000) | st.integers(), max_size=8) | _json},
    optional={
        "model": st.sampled_from(["default", "other", "tiny", "zz"]) | _json,
        "max_tokens": st.integers(-3, 200) | _json,
        "temperature": st.floats(allow_nan=False) | _json,
        "top_p": st.floats(allow_nan=False) | _json,
        "top_k": st.integers(-2, 10**6) | _json,
        "stop": st.lists(st.text(max_size=20), max_size=3) | _json,
        "stream": st.booleans() | _json,
        "seed": st.integers() | _json,
        "messages": _json,
    },
)


@_FUZZ
@given(body=_bodies, chat=st.booleans())
def test_fuzzed_http_bodies_get_a_client_status_code(
    http: httpx.Client, body: dict[str, Any], chat: bool
) -> None:
    path = "/v1/chat/completions" if chat else "/v1/completions"
    r = http.post(path, content=json.dumps(body), headers={"content-type": "application/json"})
    assert r.status_code in (200, 400, 404, 413, 429), r.text


def test_the_server_still_serves_after_the_fuzzing(
    grpc_stub: pb_grpc.GenerationStub, http: httpx.Client
) -> None:
    assert _generate(grpc_stub, PROMPT, max_tokens=4)[-1].finish_reason == "length"
    assert http.get("/health").json()["status"] == "ok"


# ----- finding 8: graceful drain (last: it stops the servers) -----------------------------


def _sse_events(client: httpx.Client, body: dict[str, Any], started: threading.Event) -> list[str]:
    events = []
    with client.stream("POST", "/v1/completions", json=body) as r:
        for line in r.iter_lines():
            if line.startswith("data: "):
                events.append(line[len("data: ") :])
                started.set()
    return events


def _finish_reason(event: str) -> str:
    return str(json.loads(event)["choices"][0]["finish_reason"])


def test_sigterm_drains_refusing_new_requests_finishing_streams_and_ending_the_rest_with_done(
    cluster: Served,
    channel: grpc.Channel,
    grpc_stub: pb_grpc.GenerationStub,
    https_url: str,
    tls_context: ssl.SSLContext,
) -> None:
    short = {"prompt": PROMPT, "max_tokens": 60, "ignore_eos": True, "stream": True}
    # Seconds of decoding on the tiny model, even alone on the machine: still running at the
    # drain timeout.
    long = {**short, "model": "other", "max_tokens": LONG_MODEL_LEN - 48}
    req = build_request(PROMPT, {"max_tokens": 60, "ignore_eos": True})
    short_started, long_started = threading.Event(), threading.Event()
    with (
        _client(https_url, tls_context) as acme,
        _client(https_url, tls_context, KEY_GAMMA) as gamma,
        concurrent.futures.ThreadPoolExecutor(3) as pool,
    ):
        stream = grpc_stub.Generate(req, timeout=120, metadata=auth_metadata(KEY_ACME))
        first = next(stream)
        short_sse = pool.submit(_sse_events, acme, short, short_started)
        long_sse = pool.submit(_sse_events, gamma, long, long_started)
        assert short_started.wait(60) and long_started.wait(60)
        # Leave Ray first: the serve process stops its Ray cluster when it exits.
        ray.shutdown()
        cluster.process.send_signal(signal.SIGTERM)
        health = health_pb2_grpc.HealthStub(channel)

        def not_serving() -> bool:
            answer = health.Check(health_pb2.HealthCheckRequest(), timeout=10)
            return bool(answer.status == health_pb2.HealthCheckResponse.NOT_SERVING)

        wait_for(not_serving, 30, "gRPC health NOT_SERVING while draining", interval_s=0.01)
        refused = _grpc_error(lambda: _generate(grpc_stub, PROMPT, max_tokens=2))
        http_health = acme.get("/health")
        rest = list(stream)
        short_events, long_events = short_sse.result(), long_sse.result()
        rc = cluster.process.wait(120)
    assert rc == 0, cluster.log.read_text()
    assert refused.code() == grpc.StatusCode.UNAVAILABLE
    assert "shutting down" in (refused.details() or "")
    assert http_health.status_code == 503 and http_health.json()["status"] == "draining"
    assert rest[-1].finish_reason == "length" and len(_tokens([first, *rest])) == 60
    assert short_events[-1] == "[DONE]" and _finish_reason(short_events[-2]) == "length"
    # Past drain_timeout_s the long stream is aborted, and still ends properly.
    assert long_events[-1] == "[DONE]" and _finish_reason(long_events[-2]) == "abort"

"""LoRA adapters through the cluster: selected by OpenAI `model` and gRPC `adapter`, limited
per tenant, listed by /v1/models, kept apart in the prefix cache and its routing, routed
by residency (a hot adapter gathers where it is loaded, a cold one goes to a free slot),
and counted per adapter in the ingress metrics.

Each worker has one LoRA slot (`max_loras: 1`), so two adapters on one worker evict
each other. The oracle is the offline engine on the same adapters (itself equal to
HF + PEFT: tests/test_lora_engine.py).
"""

from __future__ import annotations

import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import httpx
import pytest
from cluster_fixtures import (
    BLOCK_SIZE,
    MAX_MODEL_LEN,
    NUM_KV_BLOCKS,
    pool_status,
    stub,
    tokens_of,
    wait_for,
    wait_until_no_block_leaked,
)
from lora_adapters import build_lora_adapter

from pagefleet import LLM, SamplingParams
from pagefleet.cluster.app import RunningCluster, start_cluster
from pagefleet.cluster.client import auth_metadata, build_request
from pagefleet.cluster.config import ClusterConfig
from pagefleet.worker.tiny_model import ensure_tiny_model

pytestmark = [pytest.mark.cluster, pytest.mark.slow]

KEY_ACME = "acme-key-0123456789"  # may use alpha only
KEY_GLOBEX = "globex-key-0123456789"  # may use every adapter of the pool
MAX_TOKENS = 8
PROMPT = [(7 * j) % 200 + 3 for j in range(24)]  # six blocks


@dataclass
class Served:
    cluster: RunningCluster
    adapters: dict[str, Path]
    offline: LLM

    def expected(self, prompt: list[int], adapter: str | None) -> list[int]:
        return list(self._offline(prompt, adapter).token_ids)

    def expected_text(self, prompt: list[int], adapter: str | None) -> str:
        return str(self._offline(prompt, adapter).text)

    def _offline(self, prompt: list[int], adapter: str | None) -> Any:
        params = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)
        return self.offline.generate([prompt], params, adapter=adapter)[0]


def lora_config(adapters: dict[str, Path]) -> ClusterConfig:
    return ClusterConfig.from_dict(
        {
            "pools": [{
                "name": "default", "workers": 2, "model": "tiny", "block_size": BLOCK_SIZE,
                "num_kv_blocks": NUM_KV_BLOCKS, "max_model_len": MAX_MODEL_LEN, "max_num_seqs": 4,
                "device": "cpu", "lora_adapters": {k: str(v) for k, v in adapters.items()},
                "max_loras": 1,
            }],
            "tenants": [
                {"name": "acme", "pool": "default", "api_key": KEY_ACME, "adapters": ["alpha"]},
                {"name": "globex", "pool": "default", "api_key": KEY_GLOBEX},
            ],
            "router": {"policy": "prefix_affinity"},
            "scheduler": {"report_interval_s": 0.2, "report_timeout_s": 2.0},
            "server": {"host": "127.0.0.1", "grpc_port": 0, "http_port": 0},
        }
    )  # fmt: skip


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    model_dir = ensure_tiny_model()
    root = tmp_path_factory.mktemp("cluster-adapters")
    adapters = {
        "alpha": build_lora_adapter(model_dir, root / "alpha", seed=1, rank=8),
        "beta": build_lora_adapter(model_dir, root / "beta", seed=2, rank=4),
    }
    offline = LLM(
        "tiny", block_size=BLOCK_SIZE, num_kv_blocks=NUM_KV_BLOCKS, max_model_len=MAX_MODEL_LEN,
        lora_adapters=adapters,
    )  # fmt: skip
    running = start_cluster(lora_config(adapters))
    try:
        yield Served(running, adapters, offline)
    finally:
        running.shutdown()


def _http(served: Served, key: str) -> httpx.Client:
    assert served.cluster.http_url is not None
    return httpx.Client(
        base_url=served.cluster.http_url, headers={"Authorization": f"Bearer {key}"}, timeout=120
    )


def _complete(served: Served, key: str, model: str, prompt: list[int]) -> httpx.Response:
    with _http(served, key) as http:
        body = {"model": model, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0,
                "ignore_eos": True}  # fmt: skip
        return http.post("/v1/completions", json=body)


def _grpc(
    served: Served, key: str, prompt: list[int], adapter: str = "", session: str = ""
) -> list[Any]:
    channel, s = stub(served.cluster.grpc_target)
    metadata = auth_metadata(key) + ([("x-session-id", session)] if session else [])
    with channel:
        req = build_request(prompt, {"max_tokens": MAX_TOKENS, "ignore_eos": True})
        req.adapter = adapter
        return list(s.Generate(req, timeout=120, metadata=metadata))


def _worker_of(served: Served, prompt: list[int], adapter: str, session: str = "") -> str:
    """The worker that served one request on `adapter` (output checked against the oracle)."""
    out = _grpc(served, KEY_GLOBEX, prompt, adapter=adapter, session=session)
    assert tokens_of(out) == served.expected(prompt, adapter)
    return str(out[-1].worker_id)


def _fresh_prompt(n: int) -> list[int]:
    """Five blocks no other prompt of this module starts with (prefix hits decide nothing)."""
    return [(17 * j + 31 * n) % 170 + 20 for j in range(20)]


def _resident(served: Served) -> dict[str, tuple[str, ...]]:
    workers = pool_status(served.cluster.grpc_target, api_key=KEY_GLOBEX).workers
    return {w.worker_id: tuple(w.resident_adapters) for w in workers}


def _metric(served: Served, name: str, **labels: str) -> float:
    """One counter of the ingress's /metrics (0.0 while the series does not exist)."""
    url = f"http://127.0.0.1:{served.cluster.metrics_port}/metrics"
    body = urllib.request.urlopen(url, timeout=10).read().decode()
    series = name + "{" + ",".join(f'{k}="{v}"' for k, v in sorted(labels.items())) + "} "
    line = next((line for line in body.splitlines() if line.startswith(series)), None)
    return 0.0 if line is None else float(line.removeprefix(series))


def test_a_hot_adapter_gathers_on_its_worker_and_a_cold_one_takes_the_free_slot(
    served: Served,
) -> None:
    # First in the module: no adapter is resident yet, each worker has one free slot.
    wait_for(lambda: len(_resident(served)) == 2, 60, "both workers in the pool's status")
    assert all(not held for held in _resident(served).values())
    home = _worker_of(served, _fresh_prompt(0), "alpha")
    wait_for(lambda: _resident(served)[home] == ("alpha",), 30, "alpha resident on its worker")
    # beta is cold: the worker holding alpha would have to evict it, the other has a free slot.
    other = _worker_of(served, _fresh_prompt(1), "beta")
    assert other != home
    # Both are hot now, each on its own worker: new prompts (no prefix hit) follow the adapter.
    for n in range(2, 5):
        assert _worker_of(served, _fresh_prompt(n), "alpha") == home
    assert _worker_of(served, _fresh_prompt(5), "beta") == other
    wait_for(
        lambda: _resident(served) == {home: ("alpha",), other: ("beta",)}, 30,
        "each adapter resident on its own worker",
    )


def _http_text(response: httpx.Response) -> str:
    assert response.status_code == 200, response.text
    return str(response.json()["choices"][0]["text"])


def test_openai_model_names_an_adapter_and_its_output_is_the_adapters(served: Served) -> None:
    base, alpha = served.expected_text(PROMPT, None), served.expected_text(PROMPT, "alpha")
    assert base != alpha  # the adapter changes the output, so equality below means something
    got_alpha = _complete(served, KEY_GLOBEX, "alpha", PROMPT)
    assert _http_text(got_alpha) == alpha and got_alpha.json()["model"] == "alpha"
    assert _http_text(_complete(served, KEY_GLOBEX, "default", PROMPT)) == base


def test_grpc_adapter_field_selects_the_adapter(served: Served) -> None:
    prompt = [p + 1 for p in PROMPT]
    beta = served.expected(prompt, "beta")
    assert beta != served.expected(prompt, None)
    out = _grpc(served, KEY_GLOBEX, prompt, adapter="beta")
    assert tokens_of(out) == beta and out[-1].finish_reason == "length"


def test_an_adapter_the_tenant_may_not_use_answers_like_an_unknown_one(served: Served) -> None:
    for model in ("beta", "gamma"):
        r = _complete(served, KEY_ACME, model, PROMPT)
        assert r.status_code == 404 and r.json()["error"]["message"] == f"model {model!r} does not exist"
    for adapter in ("beta", "gamma"):
        with pytest.raises(grpc.RpcError) as exc:
            _grpc(served, KEY_ACME, PROMPT, adapter=adapter)
        assert exc.value.code() == grpc.StatusCode.NOT_FOUND
        assert exc.value.details() == f"unknown LoRA adapter {adapter!r}"
    # Its own adapter works on both fronts.
    assert tokens_of(_grpc(served, KEY_ACME, PROMPT, adapter="alpha")) == served.expected(PROMPT, "alpha")
    assert _http_text(_complete(served, KEY_ACME, "alpha", PROMPT)) == served.expected_text(PROMPT, "alpha")


def test_models_lists_the_pool_and_the_adapters_each_tenant_may_use(served: Served) -> None:
    def listed(key: str) -> list[tuple[str, str | None]]:
        with _http(served, key) as http:
            return [(m["id"], m["parent"]) for m in http.get("/v1/models").json()["data"]]

    assert listed(KEY_GLOBEX) == [("default", None), ("alpha", "default"), ("beta", "default")]
    assert listed(KEY_ACME) == [("default", None), ("alpha", "default")]
    with _http(served, KEY_ACME) as http:
        assert http.get("/v1/models/alpha").json()["parent"] == "default"
        assert http.get("/v1/models/beta").status_code == 404


def test_the_prefix_cache_is_shared_within_an_adapter_and_never_across(served: Served) -> None:
    prompt = [(11 * j) % 190 + 5 for j in range(28)]  # seven blocks, new to every worker

    def cached(adapter: str) -> tuple[int, str]:
        last = _grpc(served, KEY_GLOBEX, prompt, adapter=adapter)[-1]
        return last.usage.cached_tokens, last.worker_id

    assert cached("")[0] == 0
    # The base model's blocks of this prompt are no use to an adapter (its hashes differ),
    first_alpha, _ = cached("alpha")
    assert first_alpha == 0
    # but a second request on the same adapter is routed to them and reuses them.
    again, _ = cached("alpha")
    assert again >= len(prompt) - BLOCK_SIZE
    assert cached("beta")[0] == 0
    wait_until_no_block_leaked(
        [(w, h) for ws in served.cluster.workers.values() for w, h in ws]
    )


def test_status_shows_each_workers_adapters_and_to_a_tenant_only_its_own(served: Served) -> None:
    _grpc(served, KEY_GLOBEX, PROMPT, adapter="beta")  # beta is resident somewhere now
    target = served.cluster.grpc_target

    def resident(key: str) -> set[str]:
        return {a for w in pool_status(target, api_key=key).workers for a in w.resident_adapters}

    wait_for(lambda: "beta" in resident(KEY_GLOBEX), 30, "beta in a worker's resident adapters")
    assert resident(KEY_ACME) <= {"alpha"}


def test_requests_tokens_loads_and_evictions_are_counted_per_adapter(served: Served) -> None:
    # One session pins both adapters to one worker, whose single slot they must share.
    worker = _worker_of(served, _fresh_prompt(10), "alpha", session="lora-metrics")
    wait_for(lambda: _resident(served)[worker] == ("alpha",), 30, "alpha resident on its worker")
    slots = ("lora_adapter_loads_total", "lora_adapter_evictions_total")
    usage = ("lora_adapter_requests_total", "lora_adapter_generated_tokens_total")

    def counts() -> dict[tuple[str, str], float]:
        out = {(name, a): _metric(served, name, pool="default", worker=worker, adapter=a)
               for name in slots for a in ("alpha", "beta")}  # fmt: skip
        out.update({(name, a): _metric(served, name, pool="default", adapter=a)
                    for name in usage for a in ("alpha", "beta")})  # fmt: skip
        return out

    before = counts()
    assert _worker_of(served, _fresh_prompt(11), "beta", session="lora-metrics") == worker
    assert _worker_of(served, _fresh_prompt(12), "alpha", session="lora-metrics") == worker
    # beta evicted alpha and was loaded; alpha evicted beta and was loaded again.
    expected = {
        **{(name, a): before[(name, a)] + 1 for name in slots for a in ("alpha", "beta")},
        **{("lora_adapter_requests_total", a): before[("lora_adapter_requests_total", a)] + 1
           for a in ("alpha", "beta")},
        **{("lora_adapter_generated_tokens_total", a):
           before[("lora_adapter_generated_tokens_total", a)] + MAX_TOKENS
           for a in ("alpha", "beta")},
    }  # fmt: skip
    wait_for(lambda: counts() == expected, 30, f"the per-adapter counters at {expected}")

"""The README's server on the real model: SmolLM2 behind Ray, asked by the official `openai` client.

One cluster for the module: pool "default", one CPU worker on
smollm2-135m-instruct, no tenants (an open server: any API key, or none, is
accepted), gRPC and HTTP on free ports.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import httpx
import pytest
from cluster_fixtures import generate
from smollm2 import SMOLLM2, smollm2_dir

from pagefleet.cluster.app import RunningCluster, start_cluster
from pagefleet.cluster.config import ClusterConfig
from pagefleet.worker.llm import LLM
from pagefleet.worker.sampling_params import SamplingParams

openai = pytest.importorskip("openai", reason="the openai client is in the test extra")

pytestmark = [pytest.mark.cluster, pytest.mark.slow, pytest.mark.timeout(300)]

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
POOL = {"model": SMOLLM2, "workers": 1, "num_kv_blocks": 64, "device": "cpu"}


@pytest.fixture(scope="module")
def cluster() -> Iterator[RunningCluster]:
    smollm2_dir()  # skips loudly without the model package; converts it once otherwise
    config = ClusterConfig.from_dict(
        {
            "pools": [{"name": "default", **POOL}],
            "server": {"host": "127.0.0.1", "grpc_port": 0, "http_port": 0},
        }
    )
    started = time.monotonic()
    running = start_cluster(config)
    print(f"\nSmolLM2 cluster ready in {time.monotonic() - started:.1f} s")
    try:
        yield running
    finally:
        running.shutdown()


@pytest.fixture(scope="module")
def client(cluster: RunningCluster) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{cluster.http_url}/v1", api_key="x", timeout=120)


@pytest.fixture(scope="module")
def offline() -> LLM:
    return LLM(model=SMOLLM2, num_kv_blocks=16)


def test_openai_client_with_any_key_gets_the_answer_and_stop(client: openai.OpenAI) -> None:
    reply = client.chat.completions.create(
        model="default", messages=QUESTION, temperature=0, max_tokens=24  # type: ignore[arg-type]
    )
    assert "Paris" in (reply.choices[0].message.content or "")
    assert reply.choices[0].finish_reason == "stop"


def test_open_server_needs_no_key_at_all(cluster: RunningCluster) -> None:
    body = {"messages": QUESTION, "temperature": 0, "max_tokens": 24}
    r = httpx.post(f"{cluster.http_url}/v1/chat/completions", json=body, timeout=120)
    assert r.status_code == 200 and "Paris" in r.json()["choices"][0]["message"]["content"]


def test_chat_logprobs_equal_the_offline_engines(client: openai.OpenAI, offline: LLM) -> None:
    reply = client.chat.completions.create(
        model="default", messages=QUESTION, temperature=0, max_tokens=8,  # type: ignore[arg-type]
        logprobs=True, top_logprobs=2,
    )  # fmt: skip
    content = reply.choices[0].logprobs.content  # type: ignore[union-attr]
    expected = offline.chat(QUESTION, SamplingParams(max_tokens=8, logprobs=2))[0].logprobs
    assert expected is not None and content is not None and len(content) == len(expected)
    for got, want in zip(content, expected, strict=True):
        assert got.logprob == pytest.approx(want.logprob, abs=1e-4)
        assert [t.logprob for t in got.top_logprobs] == pytest.approx(
            [lp for _, lp in want.top], abs=1e-4
        )
    text = "".join(t.token for t in content)
    assert text.startswith(reply.choices[0].message.content or "")


def test_completion_logprobs_have_one_entry_per_token(client: openai.OpenAI) -> None:
    reply = client.completions.create(
        model="default", prompt="The capital of France is", max_tokens=6, temperature=0,
        logprobs=3,
    )  # fmt: skip
    logprobs = reply.choices[0].logprobs
    assert logprobs is not None and logprobs.tokens and logprobs.token_logprobs
    assert reply.usage is not None and len(logprobs.tokens) == reply.usage.completion_tokens
    assert all(len(alternatives) <= 3 for alternatives in logprobs.top_logprobs or [])
    assert all(lp <= 0.0 for lp in logprobs.token_logprobs)


def test_grpc_logprobs_come_with_each_messages_tokens(cluster: RunningCluster) -> None:
    messages = generate(
        f"127.0.0.1:{cluster.grpc_port}", "The capital of France is", max_tokens=6,
        temperature=0.0, logprobs=1,
    )  # fmt: skip
    tokens = [t for m in messages for t in m.token_ids]
    entries = [e for m in messages for e in m.logprobs]
    assert [e.token_id for e in entries] == tokens and tokens
    assert all(len(e.top_logprobs) == 1 for e in entries)

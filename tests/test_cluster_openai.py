"""The OpenAI HTTP API end to end: a local Ray, CPU workers on the tiny model, a real httpx client.

One cluster for the whole module: pool "default" (2 workers, tenant "acme")
and pool "other" (1 worker, tenant "globex"); every tenant has an API key, so
requests without one are refused. The first tests need no cluster (request
parsing); the tests that fill a pool or disconnect run last.
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import json
import socket
import time
from collections.abc import Iterator
from typing import Any

import grpc
import httpx
import pytest
import ray
from cluster_fixtures import local_cluster, pool_status, wait_for

from pagefleet import LLM, SamplingParams
from pagefleet.cli import CommandError
from pagefleet.cluster.api import IngressError
from pagefleet.cluster.app import RunningCluster
from pagefleet.cluster.config import ClusterConfig
from pagefleet.cluster.openai.protocol import chat_prompt, parse_request
from pagefleet.commands.serve import check_port_free, load_config
from pagefleet.worker.engine import EngineStats

BLOCK_SIZE = 16
NUM_KV_BLOCKS = 128
MAX_MODEL_LEN = 1024  # room for the long request the disconnect test abandons
KEY_ACME = "sk-acme-test-0123456789abcdef"
KEY_GLOBEX = "sk-globex-test-0123456789abcdef"
PROMPT = "The quick brown fox"
SESSION_HEADER = "x-correlation-id"

pytestmark = [pytest.mark.cluster, pytest.mark.slow, pytest.mark.timeout(300)]


def openai_cluster_config() -> ClusterConfig:
    pool = {
        "model": "tiny",
        "block_size": BLOCK_SIZE,
        "num_kv_blocks": NUM_KV_BLOCKS,
        "max_model_len": MAX_MODEL_LEN,
        "max_num_seqs": 4,
        "max_num_batched_tokens": 256,
        "device": "cpu",
    }
    return ClusterConfig.from_dict(
        {
            "pools": [
                {"name": "default", "workers": 2, **pool},
                {"name": "other", "workers": 1, **pool},
            ],
            "tenants": [
                {"name": "acme", "pool": "default", "api_key": KEY_ACME},
                {"name": "globex", "pool": "other", "api_key": KEY_GLOBEX},
            ],
            # Admission by prompt: the full-pool test holds four long streams on one worker.
            "scheduler": {
                "report_interval_s": 0.2, "report_timeout_s": 2.0, "wait_queue_size": 2,
                "admission": "prompt",
            },
            "server": {"host": "127.0.0.1", "grpc_port": 0, "http_port": 0},
            # Sessions named as some clients name them (test_session_affinity: the default).
            "router": {"session_header": SESSION_HEADER},
        }
    )


# ----- request parsing (no cluster) -----------------------------------------------


def test_chat_without_template_joins_role_lines_and_ends_with_assistant() -> None:
    class NoTemplate:
        chat_template = None

    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    assert chat_prompt(messages, NoTemplate()) == "system: Be brief.\nuser: Hi\nassistant:"


def test_parse_accepts_a_stop_string_and_a_batch_of_one_prompt() -> None:
    parsed = parse_request({"prompt": ["Hello"], "stop": "\n", "temperature": 0}, chat=False)
    assert parsed.prompt == "Hello"
    assert parsed.params.stop == ("\n",)
    assert parsed.params.temperature == 0.0


def test_parse_takes_vllms_priority_extension_and_checks_its_type() -> None:
    assert parse_request({"prompt": "Hello", "priority": 5}, chat=False).priority == 5
    chat = {"messages": [{"role": "user", "content": "Hi"}], "priority": -1}
    assert parse_request(chat, chat=True).priority == -1
    assert parse_request({"prompt": "Hello"}, chat=False).priority == 0
    with pytest.raises(IngressError, match="priority must be an integer"):
        parse_request({"prompt": "Hello", "priority": "high"}, chat=False)


def test_parse_takes_n_as_the_completions_to_generate_and_return() -> None:
    parsed = parse_request({"prompt": "Hello", "n": 3}, chat=False)
    assert (parsed.params.n, parsed.choices, parsed.params.logprobs) == (3, 3, None)
    with pytest.raises(IngressError, match=r"n must be an integer >= 1, got 0"):
        parse_request({"prompt": "Hello", "n": 0}, chat=False)


def test_parse_generates_best_of_candidates_with_logprobs_to_rank_them() -> None:
    parsed = parse_request({"prompt": "Hello", "n": 2, "best_of": 4}, chat=False)
    assert (parsed.params.n, parsed.choices, parsed.params.logprobs) == (4, 2, 0)
    assert not parsed.return_logprobs
    asked = parse_request({"prompt": "Hello", "best_of": 3, "logprobs": 2}, chat=False)
    assert (asked.params.logprobs, asked.return_logprobs) == (2, True)


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"n": 3, "best_of": 2}, r"best_of must be in \[n, 8\] \(n = 3\), got 2"),
        ({"best_of": 9}, r"best_of must be in \[n, 8\] \(n = 1\), got 9"),
        ({"best_of": 2, "stream": True}, r"best_of cannot be used with stream: true"),
    ],
)
def test_parse_refuses_best_of_below_n_above_its_limit_or_streamed(fields: dict, message: str) -> None:
    with pytest.raises(IngressError, match=message):
        parse_request({"prompt": "Hello", **fields}, chat=False)


def test_parse_refuses_best_of_on_chat_naming_the_endpoint() -> None:
    with pytest.raises(IngressError, match=r"best_of is not supported by this server on /v1/chat/completions"):
        parse_request({"messages": [{"role": "user", "content": "Hi"}], "best_of": 2}, chat=True)


WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather", "description": "The weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}  # fmt: skip


def test_parse_reads_tools_and_leaves_them_out_under_tool_choice_none() -> None:
    body = {"messages": [{"role": "user", "content": "Hi"}], "tools": [WEATHER], "tool_choice": "auto"}
    (tool,) = parse_request(body, chat=True).tools
    assert (tool.name, tool.description) == ("get_weather", "The weather in a city")
    assert tool.to_template() == WEATHER
    assert parse_request({**body, "tool_choice": "none"}, chat=True).tools == ()
    assert parse_request({"messages": body["messages"]}, chat=True).tools == ()


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"tools": [{"type": "retrieval"}]}, r'tools\[0\] must be \{"type": "function"'),
        ({"tools": [{"type": "function", "function": {"name": "a b"}}]},
         r"tools\[0\].function.name must be 1 to 64 letters, digits, '_' or '-', got 'a b'"),
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": []}}]},
         r"tools\[0\].function.parameters must be a JSON schema object"),
        ({"tools": [WEATHER] * 129}, r"tools may list at most 128 functions, got 129"),
        ({"tools": [{"type": "function", "function": {"name": "f", "description": "x" * 70000}}]},
         r"tools are \d+ bytes as JSON; at most 65536 are allowed"),
        ({"tool_choice": "required"}, r"tool_choice 'required' is not supported by this server"),
        ({"tool_choice": {"type": "function", "function": {"name": "f"}}},
         r"tool_choice \{.*\} is not supported by this server"),
    ],
)  # fmt: skip
def test_parse_refuses_malformed_tools_and_a_tool_choice_it_cannot_honour(
    fields: dict, message: str
) -> None:
    with pytest.raises(IngressError, match=message):
        parse_request({"messages": [{"role": "user", "content": "Hi"}], **fields}, chat=True)


def test_tools_go_to_a_chat_template_that_renders_them_and_are_refused_by_one_that_does_not(
    offline: LLM,
) -> None:
    tokenizer = copy.deepcopy(offline.tokenizer)
    tokenizer.chat_template = (
        "{% for t in tools or [] %}tool {{ t.function.name }}: {{ t.function.description }}\n{% endfor %}"
        "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}assistant:"
    )
    parsed = parse_request({"messages": [{"role": "user", "content": "Hi"}], "tools": [WEATHER]}, chat=True)
    ids = chat_prompt(parsed.prompt, tokenizer, parsed.tools)  # type: ignore[arg-type]
    assert tokenizer.decode(ids) == "tool get_weather: The weather in a city\nuser: Hi\nassistant:"
    tokenizer.chat_template = "{% for m in messages %}{{ m.content }}{% endfor %}"
    with pytest.raises(IngressError, match="its chat template does not render tools"):
        chat_prompt(parsed.prompt, tokenizer, parsed.tools)  # type: ignore[arg-type]
    with pytest.raises(IngressError, match="it has no chat template"):
        chat_prompt(parsed.prompt, offline.tokenizer, parsed.tools)  # type: ignore[arg-type]


def test_parse_rejects_a_batch_of_two_prompts() -> None:
    with pytest.raises(IngressError, match="batched prompts are not supported"):
        parse_request({"prompt": ["a", "b"]}, chat=False)


def test_parse_refuses_a_bool_posing_as_a_number_naming_the_field() -> None:
    with pytest.raises(IngressError, match=r"temperature must be a number >= 0, got True"):
        parse_request({"prompt": "Hello", "temperature": True}, chat=False)


def test_parse_refuses_an_unsupported_field_unless_it_is_neutral() -> None:
    assert parse_request({"prompt": "Hello", "echo": False}, chat=False).prompt == "Hello"
    with pytest.raises(IngressError, match=r"echo is not supported by this server \(got True\)"):
        parse_request({"prompt": "Hello", "echo": True}, chat=False)


def test_parse_reads_chat_logprobs_and_max_completion_tokens() -> None:
    body = {
        "messages": [{"role": "user", "content": [{"type": "text", "text": "Hi"}]}],
        "logprobs": True, "top_logprobs": 2, "max_completion_tokens": 5,
    }  # fmt: skip
    parsed = parse_request(body, chat=True)
    assert parsed.prompt == [{"role": "user", "content": "Hi"}]
    assert (parsed.params.logprobs, parsed.params.max_tokens) == (2, 5)


def test_parse_lets_max_completion_tokens_win_over_max_tokens() -> None:
    body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 9, "max_completion_tokens": 3}
    assert parse_request(body, chat=True).params.max_tokens == 3


@pytest.mark.parametrize("role", ["wizard", "user\nsystem", "function", ""])
def test_parse_refuses_a_chat_role_outside_the_allowed_ones_naming_them(role: str) -> None:
    body = {"messages": [{"role": role, "content": "Hi"}]}
    with pytest.raises(IngressError, match=r"role .* is not supported; allowed roles: system, user, "
                       r"assistant, tool, developer"):
        parse_request(body, chat=True)


def test_parse_refuses_null_content_and_assistant_tool_calls() -> None:
    with pytest.raises(IngressError, match=r"messages\[0\].content must be a string .*got None"):
        parse_request({"messages": [{"role": "user", "content": None}]}, chat=True)
    calls = [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]
    with pytest.raises(IngressError, match=r"tool calls are not supported"):
        parse_request({"messages": [{"role": "assistant", "content": None, "tool_calls": calls}]}, chat=True)


def test_parse_refuses_a_non_text_content_part_naming_its_type() -> None:
    part = {"type": "image_url", "image_url": {"url": "http://x/y.png"}}
    body = {"messages": [{"role": "user", "content": [{"type": "text", "text": "a"}, part]}]}
    with pytest.raises(IngressError, match=r"content\[1\]: content part type 'image_url' is not supported"):
        parse_request(body, chat=True)


def test_parse_keeps_a_messages_name_and_tool_call_id_for_the_chat_template() -> None:
    messages = [
        {"role": "user", "content": "Hi", "name": "alice"},
        {"role": "tool", "content": "42", "tool_call_id": "call_1", "name": None},
    ]
    assert parse_request({"messages": messages}, chat=True).prompt == [
        {"role": "user", "content": "Hi", "name": "alice"},
        {"role": "tool", "content": "42", "tool_call_id": "call_1"},
    ]


def test_parse_refuses_a_message_name_that_is_not_a_string() -> None:
    with pytest.raises(IngressError, match=r"messages\[0\].name must be a string, got 7"):
        parse_request({"messages": [{"role": "user", "content": "Hi", "name": 7}]}, chat=True)


def test_parse_takes_vllms_continuous_usage_stats_only_when_off() -> None:
    body = {"prompt": "Hello", "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": False}}  # fmt: skip
    assert parse_request(body, chat=False).include_usage


def test_parse_reads_the_penalties_min_p_and_logit_bias() -> None:
    body = {
        "prompt": "Hello", "min_p": 0.1, "repetition_penalty": 1.2, "presence_penalty": -0.5,
        "frequency_penalty": 1, "logit_bias": {"17": -100, "3": 2.5},
    }  # fmt: skip
    p = parse_request(body, chat=False).params
    assert (p.min_p, p.repetition_penalty, p.presence_penalty, p.frequency_penalty) == (0.1, 1.2, -0.5, 1)
    assert p.logit_bias == ((3, 2.5), (17, -100.0))


@pytest.mark.parametrize(
    ("field", "message"),
    [
        ({"presence_penalty": 2.5}, r"presence_penalty must be a number in \[-2, 2\], got 2.5"),
        ({"repetition_penalty": 0}, r"repetition_penalty must be a number in \(0, 2\], got 0"),
        ({"logit_bias": {"5": 150}}, r"logit_bias values must be numbers in \[-100, 100\], got 150.0"),
        ({"logit_bias": {"x": 1}}, r"logit_bias keys must be token ids \(strings of digits\), got 'x'"),
        ({"min_p": "0.1"}, r"min_p must be a number in \[0, 1\], got '0.1'"),
    ],
)
def test_parse_refuses_penalties_outside_their_range_naming_the_limit(field: dict, message: str) -> None:
    with pytest.raises(IngressError, match=message):
        parse_request({"prompt": "Hello", **field}, chat=False)


@pytest.mark.parametrize("field", ["reasoning_effort", "max_completion_tokens", "guided_grammar"])
def test_parse_refuses_a_field_it_does_not_know_naming_it(field: str) -> None:
    with pytest.raises(IngressError, match=rf": {field} is not supported by this server on /v1/completions"):
        parse_request({"prompt": "Hello", field: 1}, chat=False)


def test_parse_accepts_the_user_label_without_effect() -> None:
    assert parse_request({"prompt": "Hello", "user": "u-1"}, chat=False).params == SamplingParams(
        temperature=1.0
    )


def _serve_args(**kw: object) -> argparse.Namespace:
    base: dict[str, object] = {"config": None, "model": None, "workers": None, "http_port": None}
    return argparse.Namespace(**{**base, **kw})


def test_serve_serves_http_on_port_8000_unless_disabled_with_minus_one() -> None:
    assert load_config(_serve_args()).server.http_port == 8000
    assert load_config(_serve_args(http_port=-1)).server.http_port is None


def test_serve_refuses_a_busy_http_port_in_one_line() -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        with pytest.raises(CommandError, match=f"127.0.0.1:{port}.*--http-port"):
            check_port_free("127.0.0.1", port, "--http-port")


# ----- the cluster ----------------------------------------------------------------


@pytest.fixture(scope="module")
def cluster() -> Iterator[RunningCluster]:
    with local_cluster(openai_cluster_config()) as running:
        yield running


@pytest.fixture(scope="module")
def http(cluster: RunningCluster) -> Iterator[httpx.Client]:
    assert cluster.http_url is not None
    headers = {"Authorization": f"Bearer {KEY_ACME}"}
    with httpx.Client(base_url=cluster.http_url, headers=headers, timeout=120) as client:
        yield client


@pytest.fixture(scope="module")
def offline() -> LLM:
    return LLM(
        model="tiny", block_size=BLOCK_SIZE, num_kv_blocks=NUM_KV_BLOCKS, max_model_len=MAX_MODEL_LEN
    )


def _worker_stats(cluster: RunningCluster, pool: str = "default") -> list[EngineStats]:
    return [ray.get(h.stats.remote(), timeout=30) for _, h in cluster.workers[pool]]


def _pool_is_clean(cluster: RunningCluster, pool: str = "default") -> bool:
    return all(
        s.live == 0 and s.free + s.cached == s.total
        for s in _worker_stats(cluster, pool)
    )


@pytest.fixture
def pool_ends_clean(cluster: RunningCluster) -> Iterator[None]:
    """After a generating test: no live blocks, and free + cached == total on every worker."""
    yield
    wait_for(lambda: _pool_is_clean(cluster), 30, "free + cached == total and no live blocks")


def _complete(http: httpx.Client, prompt: str | list[int], **fields: Any) -> dict[str, Any]:
    r = http.post("/v1/completions", json={"model": "default", "prompt": prompt, **fields})
    assert r.status_code == 200, r.text
    return dict(r.json())


def _sse_events(response: httpx.Response) -> list[Any]:
    """The `data:` payloads of an SSE response, JSON-decoded except the final "[DONE]"."""
    events: list[Any] = []
    for line in response.iter_lines():
        if line.startswith("data: "):
            payload = line[len("data: ") :]
            events.append(payload if payload == "[DONE]" else json.loads(payload))
    return events


def _error(r: httpx.Response, status: int) -> dict[str, Any]:
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) >= {"message", "type", "code"}
    return dict(error)


# ----- generation -----------------------------------------------------------------


@pytest.mark.usefixtures("pool_ends_clean")
def test_completion_equals_offline_greedy_generate(http: httpx.Client, offline: LLM) -> None:
    want = offline.generate(PROMPT, SamplingParams(max_tokens=12))[0]
    assert len(set(want.token_ids)) > 5, "reference output not diverse"
    body = _complete(http, PROMPT, max_tokens=12, temperature=0)
    assert body["object"] == "text_completion"
    assert body["choices"][0]["text"] == want.text
    assert body["choices"][0]["finish_reason"] == want.finish_reason
    assert body["usage"]["completion_tokens"] == len(want.token_ids)
    assert body["usage"]["prompt_tokens"] == len(want.prompt_token_ids)
    assert body["usage"]["total_tokens"] == len(want.token_ids) + len(want.prompt_token_ids)


@pytest.mark.usefixtures("pool_ends_clean")
def test_token_id_prompt_completes_like_the_text_prompt(http: httpx.Client, offline: LLM) -> None:
    ids = [int(t) for t in offline.tokenizer.encode(PROMPT)]
    by_ids = _complete(http, ids, max_tokens=6, temperature=0)
    by_text = _complete(http, PROMPT, max_tokens=6, temperature=0)
    assert by_ids["choices"][0]["text"] == by_text["choices"][0]["text"]


@pytest.mark.usefixtures("pool_ends_clean")
def test_streamed_chunks_concatenate_to_the_completion_and_end_with_done(
    http: httpx.Client, offline: LLM
) -> None:
    want = offline.generate(PROMPT, SamplingParams(max_tokens=12))[0]
    fields = {"model": "default", "prompt": PROMPT, "max_tokens": 12, "temperature": 0, "stream": True}
    with http.stream("POST", "/v1/completions", json=fields) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        events = _sse_events(r)
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert len(chunks) > 1  # streamed, not one blob
    assert all(c["object"] == "text_completion" for c in chunks)
    assert "".join(c["choices"][0]["text"] for c in chunks) == want.text
    assert chunks[-1]["choices"][0]["finish_reason"] == want.finish_reason
    assert all(c["choices"][0]["finish_reason"] is None for c in chunks[:-1])


@pytest.mark.usefixtures("pool_ends_clean")
def test_stream_with_include_usage_ends_with_a_usage_chunk(http: httpx.Client) -> None:
    fields = {
        "model": "default", "prompt": PROMPT, "max_tokens": 4, "temperature": 0, "stream": True,
        "stream_options": {"include_usage": True},
    }  # fmt: skip
    with http.stream("POST", "/v1/completions", json=fields) as r:
        events = _sse_events(r)
    usage_chunk = events[-2]
    assert usage_chunk["choices"] == []
    assert usage_chunk["usage"]["completion_tokens"] == 4


@pytest.mark.usefixtures("pool_ends_clean")
def test_repeated_prompt_reports_cached_prompt_tokens(http: httpx.Client) -> None:
    prompt = "A shared system prompt that spans more than two blocks of sixteen tokens each, " * 2
    first = _complete(http, prompt, max_tokens=2, temperature=0)
    second = _complete(http, prompt, max_tokens=2, temperature=0)
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] >= BLOCK_SIZE


@pytest.mark.usefixtures("pool_ends_clean")
def test_seed_makes_sampled_completions_reproducible(http: httpx.Client) -> None:
    fields = {"max_tokens": 8, "temperature": 1.0, "seed": 1234}
    assert _complete(http, PROMPT, **fields)["choices"] == _complete(http, PROMPT, **fields)["choices"]


@pytest.mark.usefixtures("pool_ends_clean")
def test_stop_string_ends_the_completion_before_it(http: httpx.Client) -> None:
    full = _complete(http, PROMPT, max_tokens=12, temperature=0)["choices"][0]["text"]
    stop = full[len(full) // 2 : len(full) // 2 + 2]
    assert stop.strip(), f"need a visible stop string, got {stop!r} from {full!r}"
    choice = _complete(http, PROMPT, max_tokens=12, temperature=0, stop=[stop])["choices"][0]
    assert choice["finish_reason"] == "stop"
    assert choice["text"] == full[: full.index(stop)]


@pytest.fixture(scope="module")
def stop_token(offline: LLM) -> tuple[int, list[int]]:
    """A token of the greedy completion of PROMPT, and the completion up to and with it."""
    full = offline.generate(PROMPT, SamplingParams(max_tokens=12, ignore_eos=True))[0].token_ids
    stop = full[6]
    return stop, full[: full.index(stop) + 1]


@pytest.mark.usefixtures("pool_ends_clean")
def test_stop_token_ids_end_the_completion_at_that_token_over_http(
    http: httpx.Client, offline: LLM, stop_token: tuple[int, list[int]]
) -> None:
    stop, tokens = stop_token
    want = offline.generate(PROMPT, SamplingParams(max_tokens=len(tokens), ignore_eos=True))[0]
    body = _complete(http, PROMPT, max_tokens=12, temperature=0, ignore_eos=True, stop_token_ids=[stop])
    assert body["choices"][0]["finish_reason"] == "stop"
    assert body["choices"][0]["text"] == want.text
    assert body["usage"]["completion_tokens"] == len(tokens)


@pytest.mark.usefixtures("pool_ends_clean")
def test_stop_token_ids_end_the_completion_at_that_token_over_grpc(
    cluster: RunningCluster, stop_token: tuple[int, list[int]]
) -> None:
    from pagefleet.cluster.client import stream_generate

    stop, tokens = stop_token
    params = SamplingParams(max_tokens=12, ignore_eos=True, stop_token_ids=(stop,))
    messages = list(stream_generate(cluster.grpc_target, PROMPT, params, api_key=KEY_ACME))
    assert [t for m in messages for t in m.token_ids] == tokens
    assert messages[-1].finish_reason == "stop"


CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there"}]


@pytest.mark.usefixtures("pool_ends_clean")
def test_penalties_and_logit_bias_shape_the_completion_as_offline(http: httpx.Client, offline: LLM) -> None:
    # Below-neutral penalties: the tiny model's greedy output never repeats a token.
    knobs = {"presence_penalty": -2.0, "repetition_penalty": 0.5, "logit_bias": {7: 3.0}}
    fields = {"max_tokens": 16, "temperature": 0, "ignore_eos": True}
    want = offline.generate(PROMPT, SamplingParams(**fields, **knobs))[0]  # type: ignore[arg-type]
    plain = offline.generate(PROMPT, SamplingParams(**fields))[0]  # type: ignore[arg-type]
    assert want.token_ids != plain.token_ids
    wire = {**knobs, "logit_bias": {"7": 3.0}}
    body = _complete(http, PROMPT, **fields, **wire)
    assert body["choices"][0]["text"] == want.text


@pytest.mark.usefixtures("pool_ends_clean")
def test_penalties_over_grpc_give_the_offline_tokens(cluster: RunningCluster, offline: LLM) -> None:
    from pagefleet.cluster.client import stream_generate

    params = SamplingParams(max_tokens=16, ignore_eos=True, frequency_penalty=-2.0, min_p=0.5)
    want = offline.generate(PROMPT, params)[0].token_ids
    assert want != offline.generate(PROMPT, SamplingParams(max_tokens=16, ignore_eos=True))[0].token_ids
    got = [t for m in stream_generate(cluster.grpc_target, PROMPT, params, api_key=KEY_ACME) for t in m.token_ids]
    assert got == want


@pytest.mark.usefixtures("pool_ends_clean")
def test_chat_completion_answers_the_role_joined_prompt(http: httpx.Client, offline: LLM) -> None:
    want = offline.generate(chat_prompt(CHAT, offline.tokenizer), SamplingParams(max_tokens=10))[0]
    r = http.post(
        "/v1/chat/completions",
        json={"model": "default", "messages": CHAT, "max_tokens": 10, "temperature": 0},
    )
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "chat.completion"
    assert body["choices"][0]["message"] == {"role": "assistant", "content": want.text}
    assert body["usage"]["completion_tokens"] == len(want.token_ids)


@pytest.mark.usefixtures("pool_ends_clean")
def test_chat_stream_has_openai_chunk_shape(http: httpx.Client, offline: LLM) -> None:
    want = offline.generate(chat_prompt(CHAT, offline.tokenizer), SamplingParams(max_tokens=10))[0]
    fields = {"model": "default", "messages": CHAT, "max_tokens": 10, "temperature": 0, "stream": True}
    with http.stream("POST", "/v1/chat/completions", json=fields) as r:
        events = _sse_events(r)
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks)
    assert text == want.text
    assert chunks[-1]["choices"][0]["finish_reason"] == want.finish_reason


# ----- n, best_of (the official openai client) ---------------------------------------


@pytest.fixture(scope="module")
def client(cluster: RunningCluster) -> Any:
    openai = pytest.importorskip("openai", reason="the openai client is in the test extra")
    return openai.OpenAI(base_url=f"{cluster.http_url}/v1", api_key=KEY_ACME, timeout=120)


@pytest.mark.usefixtures("pool_ends_clean")
def test_n_sampled_completions_are_choices_0_to_n_with_usage_summed(client: Any) -> None:
    reply = client.completions.create(
        model="default", prompt=PROMPT, n=3, temperature=0.8, seed=7, max_tokens=12, logprobs=1
    )
    assert [c.index for c in reply.choices] == [0, 1, 2]
    assert len({c.text for c in reply.choices}) > 1, "sampled completions should differ"
    tokens = [len(c.logprobs.tokens) for c in reply.choices]
    assert all(c.finish_reason in ("stop", "length") for c in reply.choices)
    assert reply.usage.completion_tokens == sum(tokens)
    single = client.completions.create(model="default", prompt=PROMPT, max_tokens=1, temperature=0)
    assert reply.usage.prompt_tokens == single.usage.prompt_tokens  # counted once


@pytest.mark.usefixtures("pool_ends_clean")
def test_n_greedy_completions_all_equal_the_single_completion(client: Any, offline: LLM) -> None:
    want = offline.generate(PROMPT, SamplingParams(max_tokens=12))[0]
    reply = client.completions.create(model="default", prompt=PROMPT, n=3, temperature=0, max_tokens=12)
    assert [c.text for c in reply.choices] == [want.text] * 3
    assert [c.finish_reason for c in reply.choices] == [want.finish_reason] * 3
    assert reply.usage.completion_tokens == 3 * len(want.token_ids)


@pytest.mark.usefixtures("pool_ends_clean")
def test_n_streamed_completions_interleave_and_reassemble_to_the_whole_answer(client: Any) -> None:
    fields = {"model": "default", "prompt": PROMPT, "n": 3, "temperature": 0.8, "seed": 11,
              "max_tokens": 16}  # fmt: skip
    whole = client.completions.create(**fields)
    texts, reasons = ["", "", ""], [None, None, None]
    order = []
    stream = client.completions.create(**fields, stream=True, stream_options={"include_usage": True})
    usage = None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for c in chunk.choices:
            assert reasons[c.index] is None, f"choice {c.index} streamed after its finish_reason"
            texts[c.index] += c.text
            reasons[c.index] = c.finish_reason
            order.append(c.index)
    assert texts == [c.text for c in whole.choices]
    assert reasons == [c.finish_reason for c in whole.choices]
    assert order != sorted(order), "the choices' chunks should interleave"
    assert usage is not None and usage.completion_tokens == whole.usage.completion_tokens


@pytest.mark.usefixtures("pool_ends_clean")
def test_chat_n_streams_each_choice_from_its_role_to_its_finish_reason(client: Any) -> None:
    fields = {"model": "default", "messages": CHAT, "n": 2, "temperature": 0.8, "seed": 5,
              "max_tokens": 10}  # fmt: skip
    whole = client.chat.completions.create(**fields)
    assert [c.index for c in whole.choices] == [0, 1]
    texts, roles, reasons = ["", ""], [None, None], [None, None]
    for chunk in client.chat.completions.create(**fields, stream=True):
        for c in chunk.choices:
            roles[c.index] = roles[c.index] or c.delta.role
            texts[c.index] += c.delta.content or ""
            reasons[c.index] = reasons[c.index] or c.finish_reason
    assert roles == ["assistant", "assistant"]
    assert texts == [c.message.content for c in whole.choices]
    assert reasons == [c.finish_reason for c in whole.choices]


@pytest.mark.usefixtures("pool_ends_clean")
def test_best_of_returns_the_candidates_of_highest_cumulative_logprob(client: Any) -> None:
    fields = {"model": "default", "prompt": PROMPT, "temperature": 1.0, "seed": 3, "max_tokens": 8}
    # best_of candidates are the n completions of the same seed: rank them here.
    every = client.completions.create(**fields, n=4, logprobs=0).choices
    ranked = sorted(every, key=lambda c: sum(c.logprobs.token_logprobs), reverse=True)
    best = client.completions.create(**fields, n=2, best_of=4)
    assert [c.index for c in best.choices] == [0, 1]
    assert [c.text for c in best.choices] == [c.text for c in ranked[:2]]
    assert all(c.logprobs is None for c in best.choices), "logprobs were not asked for"
    assert best.usage.completion_tokens == sum(len(c.logprobs.tokens) for c in every)


def test_best_of_with_stream_is_400(http: httpx.Client) -> None:
    r = http.post("/v1/completions", json={"prompt": PROMPT, "best_of": 2, "stream": True})
    assert "best_of cannot be used with stream: true" in _error(r, 400)["message"]


# ----- sessions under a renamed router.session_header ----------------------------


def test_a_bad_value_of_the_renamed_session_header_is_400_naming_it(http: httpx.Client) -> None:
    r = http.post("/v1/completions", json={"prompt": PROMPT}, headers={SESSION_HEADER: "s" * 1000})
    assert f"{SESSION_HEADER} must be at most " in _error(r, 400)["message"]


@pytest.mark.usefixtures("pool_ends_clean")
def test_x_session_id_is_not_read_once_the_session_header_is_renamed(http: httpx.Client) -> None:
    # A value the session header refuses: the request goes through because it is not read.
    r = http.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 2},
                  headers={"x-session-id": "s" * 1000})  # fmt: skip
    assert r.status_code == 200, r.text


# ----- models, health, auth -------------------------------------------------------


def test_models_lists_the_tenants_pool(http: httpx.Client) -> None:
    r = http.get("/v1/models")
    assert r.status_code == 200
    assert [m["id"] for m in r.json()["data"]] == ["default"]


def test_health_is_ok_while_every_pool_has_a_live_worker(http: httpx.Client) -> None:
    r = http.get("/health")
    assert r.status_code == 200
    assert r.json()["live_workers"] == {"default": 2}  # acme's key: its own pool only


def test_unknown_model_is_404_with_an_openai_error(http: httpx.Client) -> None:
    r = http.post("/v1/completions", json={"model": "gpt-17", "prompt": PROMPT})
    error = _error(r, 404)
    assert error["code"] == "model_not_found"
    assert "gpt-17" in error["message"]


def test_missing_api_key_is_401(cluster: RunningCluster) -> None:
    assert cluster.http_url is not None
    r = httpx.post(cluster.http_url + "/v1/completions", json={"prompt": PROMPT}, timeout=30)
    assert _error(r, 401)["type"] == "authentication_error"


def test_unknown_api_key_is_401(http: httpx.Client) -> None:
    r = http.post(
        "/v1/completions",
        json={"prompt": PROMPT},
        headers={"Authorization": "Bearer sk-nobody"},
    )
    assert "unknown API key" in _error(r, 401)["message"]


def test_another_tenants_pool_is_404_like_an_unknown_model(http: httpx.Client) -> None:
    other = http.post("/v1/completions", json={"model": "other", "prompt": PROMPT})
    unknown = http.post("/v1/completions", json={"model": "nothere", "prompt": PROMPT})
    assert _error(other, 404)["message"].replace("'other'", "'nothere'") == _error(unknown, 404)["message"]


def test_grpc_status_and_abort_need_an_api_key_when_tenants_have_keys(
    cluster: RunningCluster,
) -> None:
    from pagefleet.cluster.client import abort, get_status

    for call in (
        lambda key: get_status(cluster.grpc_target, api_key=key),
        lambda key: abort(cluster.grpc_target, "no-such-request", api_key=key),
    ):
        with pytest.raises(grpc.RpcError) as err:
            call(None)
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
        call(KEY_ACME)  # the same call with a key is answered


def test_generate_command_sends_its_api_key(
    cluster: RunningCluster, capsys: pytest.CaptureFixture[str]
) -> None:
    from pagefleet.cli import main

    argv = ["generate", PROMPT, "--target", cluster.grpc_target, "--max-tokens", "3"]
    assert main([*argv, "--api-key", KEY_ACME]) == 0
    assert capsys.readouterr().out.strip()
    assert main([*argv, "--api-key", "sk-nobody"]) == 2
    assert "UNAUTHENTICATED" in capsys.readouterr().err


def test_second_tenant_key_selects_its_own_pool(http: httpx.Client) -> None:
    r = http.post(
        "/v1/completions",
        json={"prompt": PROMPT, "max_tokens": 2, "temperature": 0},
        headers={"Authorization": f"Bearer {KEY_GLOBEX}"},
    )
    assert r.status_code == 200, r.text
    assert r.json()["model"] == "other"


# ----- bad requests ---------------------------------------------------------------


def test_too_long_prompt_is_400_with_the_limit(http: httpx.Client) -> None:
    r = http.post("/v1/completions", json={"prompt": [5] * MAX_MODEL_LEN, "max_tokens": 8})
    assert f"max_model_len {MAX_MODEL_LEN}" in _error(r, 400)["message"]


def test_too_long_prompt_with_stream_is_a_400_not_an_event_stream(http: httpx.Client) -> None:
    fields = {"prompt": [5] * MAX_MODEL_LEN, "max_tokens": 8, "stream": True}
    r = http.post("/v1/completions", json=fields)
    assert f"max_model_len {MAX_MODEL_LEN}" in _error(r, 400)["message"]


def test_negative_temperature_is_400_naming_the_field(http: httpx.Client) -> None:
    r = http.post("/v1/completions", json={"prompt": PROMPT, "temperature": -0.5})
    assert "temperature must be >= 0" in _error(r, 400)["message"]


def test_empty_prompt_is_400(http: httpx.Client) -> None:
    r = http.post("/v1/completions", json={"prompt": ""})
    assert "prompt is empty" in _error(r, 400)["message"]


def test_n_above_the_servers_limit_is_400_naming_it(http: httpx.Client) -> None:
    r = http.post("/v1/completions", json={"prompt": PROMPT, "n": 17})
    assert "n must be at most 16 (server.max_n" in _error(r, 400)["message"]


def test_tools_on_a_model_without_a_chat_template_are_400(http: httpx.Client) -> None:
    r = http.post("/v1/chat/completions", json={"messages": CHAT, "tools": [WEATHER]})
    assert "tools are not supported by this model: it has no chat template" in _error(r, 400)["message"]


def test_logit_bias_outside_the_vocabulary_is_400_naming_its_size(http: httpx.Client) -> None:
    r = http.post("/v1/completions", json={"prompt": PROMPT, "logit_bias": {"1000000": 1}})
    assert "logit_bias token id 1000000 is outside the vocabulary [0, " in _error(r, 400)["message"]


def test_a_field_the_server_does_not_know_is_400_naming_it(http: httpx.Client) -> None:
    r = http.post("/v1/chat/completions", json={"messages": CHAT, "reasoning_effort": "high"})
    assert "reasoning_effort is not supported by this server" in _error(r, 400)["message"]


def test_a_chat_role_with_a_newline_is_400_naming_the_allowed_roles(http: httpx.Client) -> None:
    messages = [{"role": "user\nsystem", "content": "Hi"}]
    r = http.post("/v1/chat/completions", json={"messages": messages})
    assert "allowed roles: system, user, assistant, tool, developer" in _error(r, 400)["message"]


@pytest.mark.parametrize(
    ("messages", "message"),
    [
        ([{"role": "user", "content": "Hi", "weight": 2}],
         "messages[0].weight is not supported by this server; a message takes role, content, "
         "name and tool_call_id"),
        ([{"role": "user", "content": [{"type": "text", "text": "Hi", "cache_control": {}}]}],
         "messages[0].content[0].cache_control is not supported by this server; a text part takes "
         "type and text"),
    ],
)  # fmt: skip
def test_an_unknown_key_of_a_chat_message_or_content_part_is_400_naming_it(
    http: httpx.Client, messages: list[dict[str, Any]], message: str
) -> None:
    r = http.post("/v1/chat/completions", json={"messages": messages})
    assert message in _error(r, 400)["message"]


def test_a_stream_option_the_server_does_not_implement_is_400_naming_it(http: httpx.Client) -> None:
    options = {"include_usage": True, "continuous_usage_stats": True}
    r = http.post("/v1/chat/completions", json={"messages": CHAT, "stream": True, "stream_options": options})
    assert "stream_options.continuous_usage_stats is not supported by this server (got True)" in (
        _error(r, 400)["message"]
    )


def test_a_message_name_on_a_model_without_a_chat_template_is_400(http: httpx.Client) -> None:
    messages = [{"role": "user", "content": "Hi", "name": "alice"}]
    r = http.post("/v1/chat/completions", json={"messages": messages})
    assert "messages[0].name is not supported by this model: it has no chat template" in (
        _error(r, 400)["message"]
    )


def test_stop_token_ids_outside_the_vocabulary_are_400_naming_its_size(http: httpx.Client) -> None:
    r = http.post("/v1/completions", json={"prompt": PROMPT, "stop_token_ids": [1000000]})
    assert "stop_token_ids token id 1000000 is outside the vocabulary [0, " in _error(r, 400)["message"]


def test_stop_token_ids_outside_the_vocabulary_are_invalid_argument_over_grpc(
    cluster: RunningCluster,
) -> None:
    from pagefleet.cluster.client import stream_generate

    params = SamplingParams(stop_token_ids=(1000000,))
    with pytest.raises(grpc.RpcError) as err:
        list(stream_generate(cluster.grpc_target, PROMPT, params, api_key=KEY_ACME))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "stop_token_ids token id 1000000 is outside the vocabulary [0, " in (err.value.details() or "")


def test_token_outside_the_vocabulary_is_400(http: httpx.Client) -> None:
    r = http.post("/v1/completions", json={"prompt": [1, 10**6], "max_tokens": 2})
    _error(r, 400)


def test_body_that_is_not_json_is_400(http: httpx.Client) -> None:
    r = http.post(
        "/v1/completions", content=b"{not json", headers={"content-type": "application/json"}
    )
    assert "not valid JSON" in _error(r, 400)["message"]


def test_unknown_route_is_404_json(http: httpx.Client) -> None:
    _error(http.get("/v1/engines"), 404)


@pytest.mark.usefixtures("pool_ends_clean")
def test_server_keeps_serving_after_bad_requests(http: httpx.Client) -> None:
    for bad in ({"prompt": ""}, {"prompt": PROMPT, "top_p": 7}, {"model": "nope", "prompt": "x"}):
        assert http.post("/v1/completions", json=bad).status_code >= 400
    assert _complete(http, PROMPT, max_tokens=3, temperature=0)["usage"]["completion_tokens"] == 3


# ----- full pool, disconnect (last) ------------------------------------------------


def test_full_pool_is_429_and_the_abandoned_streams_free_their_blocks(
    cluster: RunningCluster,
) -> None:
    # Pool "other": 1 worker x max_num_seqs 4 + wait_queue_size 2 = 6 requests admitted:
    # four run on the worker, two wait in the ingress's queue.
    assert cluster.http_url is not None
    base_url = cluster.http_url
    worker = cluster.workers["other"][0][1]
    long = {
        "prompt": PROMPT, "max_tokens": MAX_MODEL_LEN - 32, "ignore_eos": True,
        "temperature": 0, "stream": True,
    }  # fmt: skip

    async def scenario() -> httpx.Response:
        headers = {"Authorization": f"Bearer {KEY_GLOBEX}"}
        async with httpx.AsyncClient(base_url=base_url, headers=headers, timeout=120) as client:

            async def hold() -> None:
                async with client.stream("POST", "/v1/completions", json=long) as r:
                    await r.aread()  # until cancelled

            holders = [asyncio.create_task(hold()) for _ in range(6)]
            try:
                deadline = time.monotonic() + 60
                while True:  # four on the worker, two in the ingress queue: all six admitted
                    stats = await worker.stats.remote()
                    pool = await asyncio.to_thread(
                        pool_status, cluster.grpc_target, "other", KEY_GLOBEX
                    )
                    on_worker = stats.num_running + stats.num_waiting
                    if on_worker == 4 and pool.num_running + pool.num_waiting == 6:
                        break
                    assert time.monotonic() < deadline, f"six requests never admitted: {stats}"
                    await asyncio.sleep(0.05)
                return await client.post("/v1/completions", json={**long, "stream": False})
            finally:
                for task in holders:
                    task.cancel()
                await asyncio.gather(*holders, return_exceptions=True)

    r = asyncio.run(scenario())
    assert "limit 6" in _error(r, 429)["message"]
    wait_for(lambda: _pool_is_clean(cluster, "other"), 60, "pool 'other' freed after the disconnects")
    # The two clients that disconnected while queued left the ingress queue too.
    wait_for(
        lambda: pool_status(cluster.grpc_target, "other", KEY_GLOBEX).num_waiting == 0,
        30,
        "the ingress wait queue of pool 'other' empty after the disconnects",
    )


# ----- disconnect (last) ----------------------------------------------------------


def test_disconnect_mid_stream_aborts_the_request_and_frees_its_blocks(
    cluster: RunningCluster, http: httpx.Client
) -> None:
    wait_for(lambda: _pool_is_clean(cluster), 30, "a clean pool before the test")

    def totals() -> tuple[int, int]:
        stats = _worker_stats(cluster)
        return sum(s.cached for s in stats), sum(s.requests_aborted for s in stats)

    cached_before, aborted_before = totals()
    max_tokens = MAX_MODEL_LEN - 32
    # On a loaded machine the client can be descheduled long enough for the whole
    # request to finish before it disconnects; such a try proves nothing, so try again.
    for attempt in range(3):
        fields = {
            "prompt": f"Disconnect me after the first tokens, please ({attempt})",
            "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": True,
        }  # fmt: skip
        with http.stream("POST", "/v1/completions", json=fields) as r:
            assert r.status_code == 200
            # Leaving iter_lines early closes the connection mid-stream (httpx drops it).
            for line in r.iter_lines():
                if line.startswith("data: ") and json.loads(line[6:])["choices"][0]["text"]:
                    break
        wait_for(lambda: _pool_is_clean(cluster), 60, "blocks freed after the client disconnected")
        cached_after, aborted_after = totals()
        if aborted_after > aborted_before:
            break
        cached_before, aborted_before = cached_after, aborted_after
    assert aborted_after == aborted_before + 1, "the request ran to its end, three times"
    # Aborted, not run to the end: a finished request would have left all of its
    # ~max_tokens / BLOCK_SIZE full blocks cached.
    cached_added = cached_after - cached_before
    assert cached_added < max_tokens // BLOCK_SIZE // 2

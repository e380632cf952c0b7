"""The README's server on the real model: SmolLM2 behind Ray, asked by the official `openai` client.

One cluster for the module: pool "default", one CPU worker on
smollm2-135m-instruct, no tenants (an open server: any API key, or none, is
accepted), gRPC and HTTP on free ports, sessions named by `x-correlation-id`
(`router.session_header` renamed; test_session_affinity: the default).
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Iterator

import grpc
import httpx
import pytest
from cluster_fixtures import generate
from smollm2 import SMOLLM2, smollm2_dir

from pagefleet.cluster.app import RunningCluster, start_cluster
from pagefleet.cluster.client import build_request
from pagefleet.cluster.config import ClusterConfig
from pagefleet.cluster.proto import pagefleet_pb2_grpc as pb_grpc
from pagefleet.worker.llm import LLM
from pagefleet.worker.sampling_params import SamplingParams

openai = pytest.importorskip("openai", reason="the openai client is in the test extra")

pytestmark = [pytest.mark.cluster, pytest.mark.slow, pytest.mark.timeout(300)]

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
POOL = {"model": SMOLLM2, "workers": 1, "num_kv_blocks": 64, "device": "cpu"}
SESSION_HEADER = "x-correlation-id"


@pytest.fixture(scope="module")
def cluster() -> Iterator[RunningCluster]:
    smollm2_dir()  # skips loudly without the model package; converts it once otherwise
    config = ClusterConfig.from_dict(
        {
            "pools": [{"name": "default", **POOL}],
            "server": {"host": "127.0.0.1", "grpc_port": 0, "http_port": 0},
            "router": {"session_header": SESSION_HEADER},
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


def test_openai_client_n_greedy_answers_are_the_same_answer_each_with_stop(client: openai.OpenAI) -> None:
    reply = client.chat.completions.create(
        model="default", messages=QUESTION, temperature=0, max_tokens=24, n=2  # type: ignore[arg-type]
    )
    assert [c.index for c in reply.choices] == [0, 1]
    assert reply.choices[0].message.content == reply.choices[1].message.content
    assert "Paris" in (reply.choices[0].message.content or "")
    assert [c.finish_reason for c in reply.choices] == ["stop", "stop"]


def test_tools_are_refused_by_smollm2s_template_which_renders_none(client: openai.OpenAI) -> None:
    tool = {"type": "function", "function": {"name": "capital_of", "parameters": {"type": "object"}}}
    with pytest.raises(openai.BadRequestError, match="its chat template does not render tools"):
        client.chat.completions.create(
            model="default", messages=QUESTION, max_tokens=4, tools=[tool]  # type: ignore[arg-type, list-item]
        )


@pytest.mark.parametrize("role", ["tool", "developer"])
def test_a_role_smollm2s_template_does_not_name_is_400_naming_the_roles_it_takes(
    client: openai.OpenAI, role: str
) -> None:
    messages = [*QUESTION, {"role": role, "content": "Answer in one word.", "tool_call_id": "c1"}]
    with pytest.raises(openai.BadRequestError, match=r"allowed roles: system, user, assistant"):
        client.chat.completions.create(model="default", messages=messages, max_tokens=4)  # type: ignore[arg-type]


def test_openai_client_message_with_a_name_is_accepted_and_answered(client: openai.OpenAI) -> None:
    messages = [{"role": "user", "content": QUESTION[0]["content"], "name": "alice"}]
    reply = client.chat.completions.create(
        model="default", messages=messages, temperature=0, max_tokens=24  # type: ignore[arg-type]
    )
    assert "Paris" in (reply.choices[0].message.content or "")


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


def test_grpc_metadata_names_the_session_by_the_renamed_header_not_x_session_id(
    cluster: RunningCluster,
) -> None:
    # x-session-id with a value the session header refuses: it is not read.
    metadata = ((SESSION_HEADER, "corr-1"), ("x-session-id", "s" * 1000))
    with grpc.insecure_channel(f"127.0.0.1:{cluster.grpc_port}") as channel:
        call = pb_grpc.GenerationStub(channel).Generate(
            build_request("Hi", {"max_tokens": 2}), timeout=120, metadata=metadata
        )
        assert list(call)[-1].finish_reason == "length"


def test_a_bad_value_of_the_renamed_session_header_is_invalid_argument_over_grpc(
    cluster: RunningCluster,
) -> None:
    channel = grpc.insecure_channel(f"127.0.0.1:{cluster.grpc_port}")
    with channel, pytest.raises(grpc.RpcError) as err:
        list(pb_grpc.GenerationStub(channel).Generate(
            build_request("Hi", {"max_tokens": 2}), timeout=120,
            metadata=((SESSION_HEADER, "s" * 1000),),
        ))  # fmt: skip
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert f"{SESSION_HEADER} must be at most 128 characters, got 1000" in (err.value.details() or "")


# ----- structured output ----------------------------------------------------------

CITY_SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 16},
        "country": {"type": "string", "maxLength": 16},
        "population_millions": {"type": "integer", "minimum": 0, "maximum": 100},
    },
    "required": ["city", "country", "population_millions"],
}
CITY = [{"role": "user", "content": "Describe the capital of France as JSON."}]


def test_openai_client_json_schema_replies_parse_and_validate_under_sampling(
    client: openai.OpenAI,
) -> None:
    jsonschema = pytest.importorskip("jsonschema")
    for seed in (0, 1, 2):
        reply = client.chat.completions.create(
            model="default", messages=CITY, temperature=0.8, seed=seed, max_tokens=96,  # type: ignore[arg-type]
            response_format={"type": "json_schema",
                             "json_schema": {"name": "city", "schema": CITY_SCHEMA, "strict": True}},
        )  # fmt: skip
        choice = reply.choices[0]
        assert choice.finish_reason == "stop", choice.message.content
        jsonschema.validate(json.loads(choice.message.content or ""), CITY_SCHEMA)


def test_openai_client_streams_a_json_object_that_parses(client: openai.OpenAI) -> None:
    stream = client.chat.completions.create(
        model="default", messages=CITY, temperature=0, max_tokens=96, stream=True,  # type: ignore[arg-type]
        response_format={"type": "json_object"},
    )  # fmt: skip
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert chunks[-1].choices[0].finish_reason == "stop"
    assert isinstance(json.loads(text), dict)


def test_completions_take_vllms_choice_and_regex_extensions(client: openai.OpenAI) -> None:
    reply = client.completions.create(
        model="default", prompt="The capital of France is", max_tokens=8, temperature=0.8, seed=4,
        extra_body={"structured_outputs": {"choice": ["Paris", "Lyon", "Nice"]}},
    )  # fmt: skip
    assert reply.choices[0].text in ("Paris", "Lyon", "Nice")
    reply = client.completions.create(
        model="default", prompt="A year:", max_tokens=8, temperature=0.8, seed=4,
        extra_body={"guided_regex": r" ?[12][0-9]{3}"},
    )  # fmt: skip
    assert re.fullmatch(r" ?[12][0-9]{3}", reply.choices[0].text)
    assert reply.choices[0].finish_reason == "stop"


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        # Compiled on the worker: xgrammar's own words come back.
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objekt"}}}},
         'json_schema cannot be compiled: Unsupported type "objekt"'),
        ({"structured_outputs": {"regex": "[a-"}}, "the regex cannot be compiled"),
        # Checked at the front.
        ({"structured_outputs": {"choice": []}}, "structured_outputs.choice is empty"),
        ({"guided_json": {"type": "string", "description": "x" * 70000}},
         "at most 65536 bytes (64 KiB) are allowed"),
    ],
)  # fmt: skip
def test_a_bad_structured_output_is_a_400_naming_it_and_the_server_goes_on(
    client: openai.OpenAI, extra: dict, message: str
) -> None:
    with pytest.raises(openai.BadRequestError, match=re.escape(message)):
        client.completions.create(model="default", prompt="Hi", max_tokens=4, extra_body=extra)
    reply = client.completions.create(
        model="default", prompt="Hi", max_tokens=4, extra_body={"guided_choice": ["yes", "no"]}
    )
    assert reply.choices[0].text in ("yes", "no")


def test_grpc_sampling_takes_a_json_schema_a_regex_and_a_choice(cluster: RunningCluster) -> None:
    target = f"127.0.0.1:{cluster.grpc_port}"
    jsonschema = pytest.importorskip("jsonschema")
    prompt = "The capital of France as JSON:"
    messages = generate(target, prompt, max_tokens=96, temperature=0.8, seed=1, json_schema=CITY_SCHEMA)
    assert messages[-1].finish_reason == "stop"
    jsonschema.validate(json.loads("".join(m.text for m in messages)), CITY_SCHEMA)
    messages = generate(target, "A year:", max_tokens=8, temperature=0.8, regex=r" ?[12][0-9]{3}")
    assert re.fullmatch(r" ?[12][0-9]{3}", "".join(m.text for m in messages))
    messages = generate(target, "Yes or no?", max_tokens=8, choice=["yes", "no"])
    assert "".join(m.text for m in messages) in ("yes", "no")


def test_grpc_refuses_an_uncompilable_regex_with_invalid_argument(cluster: RunningCluster) -> None:
    with pytest.raises(grpc.RpcError) as err:
        generate(f"127.0.0.1:{cluster.grpc_port}", "Hi", max_tokens=4, regex="a(b")
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "the regex cannot be compiled: Regex parsing error" in (err.value.details() or "")

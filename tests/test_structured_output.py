"""Structured output through the engine: the tiny model and SmolLM2, offline (`LLM.generate`).

A completion that ends by itself ("stop") parses and validates under
sampling; unconstrained rows of a mixed batch are unchanged; a recomputed
(preempted) request and one resumed from its output so far produce what an
undisturbed one does.
"""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
from smollm2 import smollm2_dir

from pagefleet.cluster.client import build_request
from pagefleet.cluster.errors import InvalidArgument
from pagefleet.cluster.grpc_server import request_from_proto
from pagefleet.cluster.openai.protocol import parse_request
from pagefleet.worker.chat import chat_prompt
from pagefleet.worker.engine import LLMEngine, RequestError
from pagefleet.worker.llm import LLM
from pagefleet.worker.sampling_params import SamplingParams
from pagefleet.worker.structured_output import StructuredOutput

SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 12},
        "population": {"type": "integer", "minimum": 0, "maximum": 99999999},
        "capital": {"type": "boolean"},
        "tags": {"type": "array", "items": {"enum": ["old", "big", "coastal"]}, "maxItems": 3},
    },
    "required": ["city", "population", "capital", "tags"],
}
REGEX = r"(yes|no), because [a-z ]{3,20}\."
CHOICES = ("Paris", "London", "Rome")
SPECS = [
    StructuredOutput(json_schema=SCHEMA),
    StructuredOutput(json_object=True),
    StructuredOutput(regex=REGEX),
    StructuredOutput(choice=CHOICES),
]
SEEDS = (0, 1, 2, 3)
PROMPTS = ["The capital of France is", "Describe a city in JSON:", "hello world"]


def check(spec: StructuredOutput, text: str) -> None:
    """`text` matches `spec`: the schema validates, the regex fullmatches, it is a choice."""
    if spec.json_schema is not None:
        jsonschema.validate(json.loads(text), json.loads(spec.json_schema))
    elif spec.json_object:
        assert isinstance(json.loads(text), dict), text
    elif spec.regex is not None:
        assert re.fullmatch(spec.regex, text), text
    else:
        assert spec.choice is not None and text in spec.choice, text


@pytest.fixture(scope="module")
def tiny() -> LLM:
    return LLM(model="tiny", max_num_seqs=16)


@pytest.fixture(scope="module")
def smol() -> LLM:
    return LLM(model=str(smollm2_dir()), dtype="float32", max_num_seqs=16)


def params(spec: StructuredOutput | None, **kw: object) -> SamplingParams:
    return SamplingParams(**{"max_tokens": 96, "structured": spec, **kw})  # type: ignore[arg-type]


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.kind)
def test_tiny_model_output_that_stops_matches_the_spec_under_sampling(
    tiny: LLM, spec: StructuredOutput
) -> None:
    outs = tiny.generate(
        [PROMPTS[s % len(PROMPTS)] for s in SEEDS],
        [params(spec, temperature=0.8, seed=s) for s in SEEDS],
    )
    stopped = [o for o in outs if o.finish_reason == "stop"]
    # The random model wanders, but bounded grammars end within the budget.
    if spec.json_object:
        assert stopped, [o.text for o in outs]
    else:
        assert len(stopped) == len(outs), [(o.text, o.finish_reason) for o in outs]
    for out in stopped:
        check(spec, out.text)


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.kind)
def test_smollm2_chat_output_matches_the_spec_under_sampling(smol: LLM, spec: StructuredOutput) -> None:
    question = [{"role": "user", "content": "Name a European capital and describe it as JSON."}]
    prompt = chat_prompt(question, smol.tokenizer)
    outs = smol.generate(
        [prompt] * len(SEEDS), [params(spec, temperature=0.8, seed=s, max_tokens=128) for s in SEEDS]
    )
    stopped = [o for o in outs if o.finish_reason == "stop"]
    if spec.json_object:
        # Any JSON object: a sampled key or string may run on past the budget (a seed did).
        assert len(stopped) * 2 > len(outs), [(o.text, o.finish_reason) for o in outs]
    else:  # bounded grammars end within it
        assert len(stopped) == len(outs), [(o.text, o.finish_reason) for o in outs]
    for out in stopped:
        check(spec, out.text)


def test_unconstrained_rows_of_a_mixed_batch_are_what_they_are_alone(tiny: LLM) -> None:
    free = [params(None, max_tokens=24), params(None, max_tokens=24, temperature=0.8, seed=5)]
    alone = tiny.generate(PROMPTS[:2], free)
    constrained = [params(spec) for spec in SPECS]
    mixed = tiny.generate([*PROMPTS[:2], *[PROMPTS[2]] * len(SPECS)], [*free, *constrained])
    assert [o.token_ids for o in mixed[:2]] == [o.token_ids for o in alone]
    for spec, out in zip(SPECS, mixed[2:], strict=True):
        if out.finish_reason == "stop":
            check(spec, out.text)


def test_greedy_constrained_output_does_not_depend_on_its_batch(tiny: LLM) -> None:
    spec = StructuredOutput(json_schema=SCHEMA)
    alone = tiny.generate(PROMPTS[0], params(spec))[0]
    mixed = tiny.generate(PROMPTS, [params(spec), params(None), params(StructuredOutput(regex=REGEX))])
    assert mixed[0].token_ids == alone.token_ids
    assert alone.finish_reason == "stop"
    check(spec, alone.text)


def test_each_of_n_completions_follows_the_grammar_on_its_own(tiny: LLM) -> None:
    spec = StructuredOutput(regex=r"[a-z]{8}")
    out = tiny.generate(PROMPTS[0], params(spec, n=6, temperature=1.0, seed=3))[0]
    texts = [c.text for c in out.outputs]
    assert all(c.finish_reason == "stop" for c in out.outputs)
    # A matcher shared between the completions would refuse one sibling's tokens.
    assert all(re.fullmatch(spec.regex or "", t) for t in texts) and len(set(texts)) > 1, texts


def test_logprobs_come_from_the_model_distribution_not_the_mask(tiny: LLM) -> None:
    spec = StructuredOutput(choice=CHOICES)
    free = tiny.generate(PROMPTS[0], params(None, max_tokens=1, logprobs=3))[0]
    constrained = tiny.generate(PROMPTS[0], params(spec, logprobs=3))[0]
    assert constrained.logprobs is not None and free.logprobs is not None
    # Same prompt, same first-step logits: the same top alternatives, unmasked.
    assert constrained.logprobs[0].top == free.logprobs[0].top
    assert constrained.text in CHOICES


def test_a_reply_cut_by_max_tokens_ends_with_length(tiny: LLM) -> None:
    out = tiny.generate(PROMPTS[0], params(StructuredOutput(json_schema=SCHEMA), max_tokens=3))[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 3


def test_a_stop_string_still_ends_a_constrained_reply(tiny: LLM) -> None:
    spec = StructuredOutput(regex=r"abc, abc, abc")
    out = tiny.generate(PROMPTS[0], params(spec, stop=[","]))[0]
    assert out.finish_reason == "stop" and out.text == "abc"


def run_until_done(engine: LLMEngine) -> dict[str, list[int]]:
    done: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        done.update({o.request_id: o.token_ids for o in engine.step() if o.finished})
    return done


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption_keeps_the_grammar_state(tiny: LLM, mode: str) -> None:
    """Two constrained requests run; a higher-priority one arrives needing the pool and
    preempts them; they resume and end as they do undisturbed."""
    specs = {"regex": StructuredOutput(regex=r"[a-z]{40}"), "schema": StructuredOutput(json_schema=SCHEMA)}
    expected = {name: tiny.generate(PROMPTS[i], params(spec, max_tokens=64))[0]
                for i, (name, spec) in enumerate(specs.items())}  # fmt: skip
    llm = LLM(model="tiny", block_size=16, num_kv_blocks=8, preemption_mode=mode)
    engine = llm.engine
    for i, (name, spec) in enumerate(specs.items()):
        engine.add_request(name, PROMPTS[i], params(spec, max_tokens=64))
    for _ in range(6):
        engine.step()
    # 100 prompt tokens + 8: seven of the eight blocks.
    engine.add_request("high", list(range(50, 150)), SamplingParams(max_tokens=8), priority=5)
    done = run_until_done(engine)
    assert llm.stats().preemptions[mode] > 0
    for name, spec in specs.items():
        assert done[name] == expected[name].token_ids, name
        assert expected[name].finish_reason == "stop"
        check(spec, llm.tokenizer.decode(done[name], skip_special_tokens=True))
    llm.check_integrity()


def test_a_resumed_request_rebuilds_its_matcher_from_the_output_so_far(tiny: LLM) -> None:
    """What a request resubmitted after a worker failure (or a hand-off) does: the new
    worker gets prompt + output so far, `num_resumed_tokens` of it generated."""
    spec = StructuredOutput(json_schema=SCHEMA)
    prompt = tiny.tokenizer.encode(PROMPTS[1])
    whole = tiny.generate(prompt, params(spec))[0]
    assert whole.finish_reason == "stop"
    engine = tiny.engine
    for k in (1, len(whole.token_ids) // 2, len(whole.token_ids) - 1):
        engine.add_request(
            f"resume-{k}", prompt + whole.token_ids[:k], params(spec, max_tokens=96 - k),
            num_resumed_tokens=k,
        )
        rest = run_until_done(engine)[f"resume-{k}"]
        assert whole.token_ids[:k] + rest == whole.token_ids
    check(spec, whole.text)


def test_a_request_handed_off_with_its_kv_blocks_continues_its_grammar() -> None:
    """The migration path: the source exports the blocks and stops; the target imports
    them and resumes from the output so far (as `RequestRun` sends it)."""
    spec = StructuredOutput(json_schema=SCHEMA)
    source, target = (LLM(model="tiny", block_size=4, num_kv_blocks=64) for _ in range(2))
    prompt = source.tokenizer.encode(PROMPTS[1])
    whole = LLM(model="tiny").generate(prompt, params(spec))[0]
    assert whole.finish_reason == "stop"
    source.engine.add_request("r", prompt, params(spec))
    streamed: list[int] = []
    while len(streamed) < 12:
        for out in source.engine.step():
            streamed.extend(out.new_token_ids)
    exported = source.engine.export_kv("r")
    source.engine.abort_request("r")
    run_until_done(source.engine)
    assert exported is not None
    assert target.engine.import_kv(list(exported.block_hashes), exported.blocks) > 0
    target.engine.add_request(
        "r", prompt + streamed, params(spec, max_tokens=96 - len(streamed)),
        num_resumed_tokens=len(streamed),
    )  # fmt: skip
    rest = run_until_done(target.engine)["r"]
    assert streamed + rest == whole.token_ids
    assert target.stats().prefix_hit_tokens > 0
    check(spec, whole.text)


def test_resumed_tokens_the_grammar_refuses_are_a_request_error(tiny: LLM) -> None:
    prompt = tiny.tokenizer.encode("say it", add_special_tokens=False)
    with pytest.raises(RequestError, match="does not follow the choice grammar"):
        tiny.engine.add_request("bad-resume", [*prompt, *prompt], params(StructuredOutput(choice=CHOICES)),
                                num_resumed_tokens=len(prompt))  # fmt: skip
    assert not tiny.engine.has_unfinished_requests()


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        (StructuredOutput(json_schema={"type": "objekt"}), 'json_schema cannot be compiled: Unsupported type "objekt"'),
        (StructuredOutput(regex="[a-"), "regex cannot be compiled"),
    ],
)
def test_a_spec_that_cannot_compile_is_refused_and_the_engine_goes_on(
    tiny: LLM, spec: StructuredOutput, message: str
) -> None:
    with pytest.raises(RequestError, match=re.escape(message)):
        tiny.generate(PROMPTS[0], params(spec))
    assert tiny.generate(PROMPTS[0], params(StructuredOutput(choice=CHOICES)))[0].text in CHOICES


def test_structured_must_be_a_structured_output() -> None:
    with pytest.raises(ValueError, match="structured must be a StructuredOutput or None, got dict"):
        SamplingParams(structured={"regex": "a"})  # type: ignore[arg-type]


# ----- the fronts' parsing (no cluster) -------------------------------------------


@pytest.mark.parametrize(
    ("fields", "expected"),
    [
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA, "strict": True}}},
         StructuredOutput(json_schema=SCHEMA)),
        ({"response_format": {"type": "json_object"}}, StructuredOutput(json_object=True)),
        ({"response_format": {"type": "text"}}, None),
        ({"structured_outputs": {"json": json.dumps(SCHEMA)}}, StructuredOutput(json_schema=SCHEMA)),
        ({"structured_outputs": {"regex": "a+", "choice": None}}, StructuredOutput(regex="a+")),
        ({"structured_outputs": {"choice": ["a", "b"]}}, StructuredOutput(choice=("a", "b"))),
        ({"structured_outputs": {"json_object": True}}, StructuredOutput(json_object=True)),
        ({"guided_json": SCHEMA}, StructuredOutput(json_schema=SCHEMA)),
        ({"guided_regex": "a+"}, StructuredOutput(regex="a+")),
        ({"guided_choice": ["a"]}, StructuredOutput(choice=("a",))),
    ],
)  # fmt: skip
def test_openai_bodies_give_one_structured_output(fields: dict, expected: StructuredOutput | None) -> None:
    for chat, base in ((False, {"prompt": "Hi"}), (True, {"messages": [{"role": "user", "content": "Hi"}]})):
        assert parse_request({**base, **fields}, chat=chat).params.structured == expected


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"response_format": {"type": "xml"}}, 'response_format must be {"type": "text"}'),
        ({"response_format": {"type": "json_schema"}}, "response_format.json_schema must be an object"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
         "response_format.json_schema.schema is required"),
        ({"response_format": {"type": "json_schema", "json_schema": {"schema": {}, "extra": 1}}},
         "response_format.json_schema.extra is not supported"),
        ({"response_format": {"type": "json_schema", "json_schema": {"schema": "{"}}},
         "json_schema is not valid JSON"),
        ({"structured_outputs": {"grammar": "root ::= x"}}, "structured_outputs.grammar is not supported"),
        ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs must set exactly one"),
        ({"structured_outputs": {"choice": []}}, "structured_outputs.choice is empty"),
        ({"guided_choice": "a"}, "guided_choice must be a list of strings"),
        ({"guided_regex": "a", "guided_choice": ["a"]}, "set at most one of guided_regex, guided_choice"),
        ({"guided_json": {"description": "x" * 70000}}, "at most 65536 bytes (64 KiB) are allowed"),
    ],
)  # fmt: skip
def test_openai_bodies_with_a_bad_structured_output_are_refused_naming_it(fields: dict, message: str) -> None:
    with pytest.raises(InvalidArgument, match=re.escape(message)):
        parse_request({"prompt": "Hi", **fields}, chat=False)


def test_grpc_sampling_fields_give_one_structured_output() -> None:
    def parsed(**sampling: object) -> StructuredOutput | None:
        return request_from_proto(build_request("Hi", sampling)).params.structured

    assert parsed() is None
    assert parsed(json_schema=SCHEMA) == StructuredOutput(json_schema=SCHEMA)
    assert parsed(regex="a+") == StructuredOutput(regex="a+")
    assert parsed(choice=["a", "b"]) == StructuredOutput(choice=("a", "b"))
    assert parsed(json_object=True) == StructuredOutput(json_object=True)
    with pytest.raises(InvalidArgument, match=r"takes exactly one of .*; got regex, choice"):
        parsed(regex="a", choice=["a"])
    with pytest.raises(InvalidArgument, match="json_schema is not valid JSON"):
        parsed(json_schema="{")

"""The grammar module alone: StructuredOutput's checks, compiling once, masks, matchers.

Walks here draw each next token at random among those the mask allows (a
seeded generator), on the tiny model's tokenizer and on SmolLM2's: whatever
the draw, a walk that ends by itself spells a string its grammar accepts.
"""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
import torch
from smollm2 import smollm2_dir
from transformers import AutoTokenizer

from pagefleet.worker.grammar import GrammarError, Grammars, TokenMatcher, mask_logits
from pagefleet.worker.structured_output import MAX_STRUCTURED_BYTES, StructuredOutput
from pagefleet.worker.tiny_model import EOS_ID, TINY_VOCAB_SIZE, build_tiny_tokenizer

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "mood": {"enum": ["calm", "busy"]},
        "ok": {"type": "boolean"},
    },
    "required": ["name", "mood", "ok"],
}
REGEX = r"[a-c]{2,4}-\d{2}"
CHOICES = ("red", "green", 'say "hi"\n')
MAX_WALK = 80


@pytest.fixture(scope="module")
def tiny() -> Grammars:
    return Grammars(build_tiny_tokenizer(), TINY_VOCAB_SIZE, [EOS_ID])


@pytest.fixture(scope="module")
def smol() -> tuple[Grammars, object]:
    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir())
    return Grammars(tokenizer, len(tokenizer), [tokenizer.eos_token_id]), tokenizer


def walk(grammars: Grammars, spec: StructuredOutput, seed: int, vocab: int) -> tuple[list[int], bool]:
    """Draw allowed tokens uniformly until the matcher terminates (True) or MAX_WALK."""
    matcher = grammars.matcher(spec)
    gen = torch.Generator().manual_seed(seed)
    tokens: list[int] = []
    for _ in range(MAX_WALK):
        logits = mask_logits(torch.zeros(1, vocab), [matcher])
        token = int(torch.multinomial(torch.softmax(logits[0], -1), 1, generator=gen))
        assert matcher.accept(token), f"the mask allowed {token} but the matcher refused it"
        tokens.append(token)
        if matcher.terminated:
            return tokens, True
    return tokens, False


def check(spec: StructuredOutput, text: str) -> None:
    if spec.json_schema is not None:
        jsonschema.validate(json.loads(text), json.loads(spec.json_schema))
    elif spec.json_object:
        assert isinstance(json.loads(text), dict)
    elif spec.regex is not None:
        assert re.fullmatch(spec.regex, text), text
    else:
        assert spec.choice is not None and text in spec.choice


# Bounded grammars, so that a uniform walk ends (any JSON object may nest without end:
# the engine tests check json_object with a model).
SPECS = [
    StructuredOutput(json_schema=SCHEMA),
    StructuredOutput(regex=REGEX),
    StructuredOutput(choice=CHOICES),
]


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.kind)
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_random_walks_on_the_tiny_tokenizer_spell_what_the_grammar_accepts(
    tiny: Grammars, spec: StructuredOutput, seed: int
) -> None:
    tokens, ended = walk(tiny, spec, seed, TINY_VOCAB_SIZE)
    assert ended, "bounded grammars end within the walk"
    assert tokens[-1] == EOS_ID
    check(spec, build_tiny_tokenizer().decode(tokens[:-1]))


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.kind)
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_random_walks_on_smollm2_spell_what_the_grammar_accepts(
    smol: tuple[Grammars, object], spec: StructuredOutput, seed: int
) -> None:
    grammars, tokenizer = smol
    tokens, ended = walk(grammars, spec, seed, len(tokenizer))  # type: ignore[arg-type]
    assert ended, "bounded grammars end within the walk"
    check(spec, tokenizer.decode(tokens[:-1]))  # type: ignore[attr-defined]


def test_each_spec_compiles_once_and_the_cache_is_bounded() -> None:
    grammars = Grammars(build_tiny_tokenizer(), TINY_VOCAB_SIZE, [EOS_ID], max_entries=2)
    a, b, c = (StructuredOutput(regex=r) for r in ("a+", "b+", "c+"))
    grammars.compile(a)
    grammars.compile(StructuredOutput(regex="a+"))  # an equal spec: the same key
    assert grammars.compiles == 1
    grammars.compile(b)
    grammars.compile(a)  # a is now the most recently used
    grammars.compile(c)  # evicts b
    assert len(grammars) == 2 and grammars.compiles == 3
    grammars.compile(a)
    assert grammars.compiles == 3
    grammars.compile(b)
    assert grammars.compiles == 4


def test_a_schema_with_the_same_content_shares_the_key_whatever_its_spacing() -> None:
    as_text = StructuredOutput(json_schema='{"type":  "object",\n "properties": {}}')
    as_dict = StructuredOutput(json_schema={"type": "object", "properties": {}})
    assert as_text.key == as_dict.key
    assert as_text.key != StructuredOutput(regex=as_text.spec).key


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        (StructuredOutput(json_schema={"type": "objekt"}), 'json_schema cannot be compiled: Unsupported type "objekt"'),
        (StructuredOutput(json_schema={"$ref": "#/defs/x"}), "json_schema cannot be compiled: Cannot find field"),
        (StructuredOutput(regex="a(b"), "regex cannot be compiled: Regex parsing error at position 4"),
        (StructuredOutput(regex=r"[^\s\S]"), "regex allows no output at all"),
    ],
)
def test_a_spec_xgrammar_cannot_compile_is_a_grammar_error_naming_the_problem(
    tiny: Grammars, spec: StructuredOutput, message: str
) -> None:
    with pytest.raises(GrammarError, match="^the " + re.escape(message)):
        tiny.compile(spec)
    tiny.compile(StructuredOutput(regex="ok"))  # the compiler still works


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({}, "structured output takes exactly one of json_schema, json_object, regex, choice; got none"),
        ({"regex": "a", "choice": ["a"]}, "structured output takes exactly one of json_schema, json_object, regex, choice; got regex, choice"),
        ({"choice": []}, "choice is empty: at least one string is required"),
        ({"choice": ["a", ""]}, "choice must be a list of non-empty strings"),
        ({"regex": ""}, "regex is empty"),
        ({"json_schema": "[1, 2]"}, "json_schema must be a JSON object, got list"),
        ({"json_schema": "{"}, "json_schema is not valid JSON"),
        ({"regex": "x" * (MAX_STRUCTURED_BYTES + 1)}, "the structured output regex is 65537 bytes; at most 65536"),
    ],
)
def test_structured_output_refuses_bad_specs_naming_the_problem(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match="^" + re.escape(message)):
        StructuredOutput(**kwargs)


def test_masks_touch_only_constrained_rows(tiny: Grammars) -> None:
    logits = torch.randn(3, TINY_VOCAB_SIZE)
    before = logits.clone()
    matcher = tiny.matcher(StructuredOutput(choice=("red", "green")))
    out = mask_logits(logits, [None, matcher, None])
    assert torch.equal(out[0], before[0]) and torch.equal(out[2], before[2])
    allowed = torch.isfinite(out[1]).nonzero().flatten().tolist()
    tokenizer = build_tiny_tokenizer()
    assert allowed and all("red".startswith(t) or "green".startswith(t)
                           for t in (tokenizer.decode([i]) for i in allowed))
    assert mask_logits(before, [None, None, None]) is before


def test_a_matcher_rebuilt_from_accepted_tokens_allows_what_the_original_does(tiny: Grammars) -> None:
    spec = StructuredOutput(json_schema=SCHEMA)
    tokens, ended = walk(tiny, spec, 7, TINY_VOCAB_SIZE)
    assert ended
    for k in (1, len(tokens) // 2, len(tokens) - 1):
        original = tiny.matcher(spec)
        for t in tokens[:k]:
            assert original.accept(t)
        rebuilt = tiny.matcher(spec, tokens[:k])
        masks = mask_logits(torch.zeros(2, TINY_VOCAB_SIZE), [original, rebuilt])
        assert torch.equal(masks[0], masks[1])


def test_a_matcher_refuses_resumed_tokens_its_grammar_does_not_allow(tiny: Grammars) -> None:
    not_a_choice = build_tiny_tokenizer().encode("zz", add_special_tokens=False)
    with pytest.raises(GrammarError, match="does not follow the choice grammar"):
        tiny.matcher(StructuredOutput(choice=("red",)), not_a_choice)


def test_a_forked_matcher_goes_its_own_way(tiny: Grammars) -> None:
    tokenizer = build_tiny_tokenizer()
    parent = tiny.matcher(StructuredOutput(choice=("red", "green")))
    child: TokenMatcher = parent.fork()
    r, g = tokenizer.encode("r", add_special_tokens=False)[0], tokenizer.encode("g", add_special_tokens=False)[0]
    assert parent.accept(r) and child.accept(g)
    assert not parent.accept(g)


def test_a_bounded_json_string_takes_no_raw_control_character(tiny: Grammars) -> None:
    """xgrammar alone lets a raw control character into a string with maxLength
    (which JSON parsers refuse); the grammar module closes that."""
    tokenizer = build_tiny_tokenizer()
    spec = StructuredOutput(json_schema={"type": "string", "maxLength": 5})

    def accepts(text: str) -> bool:
        matcher = tiny.matcher(spec)
        return all(matcher.accept(t) for t in tokenizer.encode(text, add_special_tokens=False))

    assert not accepts('"a\x12')
    assert not accepts('"a\n')
    assert not accepts('"a\\')  # no escapes in a bounded string (nor in xgrammar's own)
    assert accepts('"a b~"')
    assert not accepts('"abcdef')

"""Our tokenizer (`pagefleet.worker.tokenizer`) equals transformers' `AutoTokenizer` on every
tokenizer the suite has (the tiny model's, SmolLM2's, the llama/qwen2/mistral checkpoints
of `hf_models`) and on Hub-shaped checkpoints (`tokenizer_checkpoints`): ids, text, chat
prompts, special tokens, xgrammar's view of it; and loading it imports neither torch nor
transformers."""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jinja2
import numpy as np
import pytest
import tokenizer_checkpoints as hub
import torch
import xgrammar as xgr
from hf_models import build_tiny_hf_model
from smollm2 import smollm2_dir
from transformers import AutoTokenizer

from pagefleet.worker.grammar import tokenizer_info
from pagefleet.worker.model_files import ModelFileError, load_tokenizer, resolve_model_path
from pagefleet.worker.tokenizer import Tokenizer

CHECKPOINTS: dict[str, Callable[[Path], Path]] = {
    "tiny": lambda _: resolve_model_path("tiny"),
    "smollm2": lambda _: smollm2_dir(),
    "hf-llama": lambda tmp: build_tiny_hf_model("llama", tmp),
    "hf-qwen2": lambda tmp: build_tiny_hf_model("qwen2", tmp),
    "hf-mistral": lambda tmp: build_tiny_hf_model("mistral", tmp),
    "llama2": lambda tmp: hub.llama_spm(tmp / "llama2"),
    "llama2-old-format": lambda tmp: hub.llama_spm(tmp / "llama2-old", old_format=True),
    "llama2-legacy-add-eos": lambda tmp: hub.llama_spm(
        tmp / "llama2-legacy", legacy=True, add_eos_token=True
    ),
    "qwen2.5": lambda tmp: hub.qwen2_style(tmp / "qwen2.5"),
    "smollm2-hub": lambda tmp: hub.gpt2_style(tmp / "gpt2"),
    "legacy-files": lambda tmp: hub.legacy_files(tmp / "legacy"),
    "wordpiece": lambda tmp: hub.wordpiece(tmp / "wordpiece"),
}

TEXTS = [
    "",
    "Hello world",
    " leading space",
    "  two  spaces\n\n\ttab   trailing   ",
    "\n\n\n",
    "Ünïcode: héllo wörld, ça va? 日本語のテキスト",
    "e\u0301 (combining) vs é, \u212b vs \u00c5",  # NFC-sensitive
    "emoji 🎉👍🏽 👩\u200d👩\u200d👧 🇫🇷",
    "control \x00\x1b\x7f and \U0010ffff",
    "<s>special</s> tokens <unk> inside <|im_start|>user\nHi<|im_end|> <|endoftext|>",
    "half <|im_ and [CLS] [SEP] [MASK] <mask> <image> <note> <extra> <pad>",
    "it 's fine , isn't it ? I 'm sure they 're right .",
    "def f(x):\n    return x ** 2  # 42, 3.14159, 1e-9",
    "aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa",
]

CONVERSATIONS = [
    [{"role": "user", "content": "Hi"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there "}],
    [
        {"role": "user", "content": "What is 2+2?"},
        {"role": "assistant", "content": " 4. "},
        {"role": "user", "content": "And <s> 3+3?", "name": None},
    ],
]
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather in a city, <b>now</b> & here",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
]


@pytest.fixture(scope="module")
def checkpoint_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("tokenizers")


@pytest.fixture(scope="module", params=list(CHECKPOINTS))
def pair(request: pytest.FixtureRequest, checkpoint_root: Path) -> tuple[Tokenizer, Any]:
    """(ours, transformers') for one checkpoint."""
    path = CHECKPOINTS[request.param](checkpoint_root)
    ours = load_tokenizer(path)
    assert isinstance(ours, Tokenizer)
    return ours, AutoTokenizer.from_pretrained(path)


@pytest.mark.parametrize("add_special_tokens", [True, False])
def test_encode_equals_transformers(pair: tuple[Tokenizer, Any], add_special_tokens: bool) -> None:
    ours, hf = pair
    for text in TEXTS:
        assert ours.encode(text, add_special_tokens=add_special_tokens) == hf.encode(
            text, add_special_tokens=add_special_tokens
        ), text


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_decode_equals_transformers_on_every_prefix(
    pair: tuple[Tokenizer, Any], skip_special_tokens: bool
) -> None:
    # Prefixes cut characters in the middle of their UTF-8 bytes.
    ours, hf = pair
    for text in TEXTS:
        ids = hf.encode(text)
        for end in range(len(ids) + 1):
            assert ours.decode(ids[:end], skip_special_tokens=skip_special_tokens) == hf.decode(
                ids[:end], skip_special_tokens=skip_special_tokens
            ), (text, end)


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_decode_of_single_ids_and_of_special_and_added_ones_equals_transformers(
    pair: tuple[Tokenizer, Any], skip_special_tokens: bool
) -> None:
    ours, hf = pair
    vocab = hf.get_vocab()
    added = sorted(hf.added_tokens_decoder)
    ids = sorted(set(range(0, len(vocab), max(1, len(vocab) // 3000))) | set(added))
    for token_id in ids:
        assert ours.decode([token_id], skip_special_tokens=skip_special_tokens) == hf.decode(
            [token_id], skip_special_tokens=skip_special_tokens
        ), token_id
    mixed = [added[0], *range(3, 40), *added, 7, added[-1]]
    assert ours.decode(mixed, skip_special_tokens=skip_special_tokens) == hf.decode(
        mixed, skip_special_tokens=skip_special_tokens
    )


def test_vocabulary_special_tokens_and_limits_equal_transformers(
    pair: tuple[Tokenizer, Any],
) -> None:
    ours, hf = pair
    assert ours.get_vocab() == hf.get_vocab()
    assert ours.special_tokens_map == hf.special_tokens_map
    assert (ours.bos_token_id, ours.eos_token_id, ours.pad_token_id) == (
        hf.bos_token_id, hf.eos_token_id, hf.pad_token_id,
    )  # fmt: skip
    assert (ours.bos_token, ours.eos_token, ours.pad_token) == (
        hf.bos_token, hf.eos_token, hf.pad_token,
    )  # fmt: skip
    assert ours.model_max_length == hf.model_max_length
    tokens = [*ours.special_tokens_map.values(), "hello", "\u0120the", "not-a-token-at-all"]
    assert ours.convert_tokens_to_ids(tokens) == hf.convert_tokens_to_ids(tokens)
    assert ours.chat_template == hf.chat_template


@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_templates_render_as_transformers_renders_them(
    pair: tuple[Tokenizer, Any], add_generation_prompt: bool
) -> None:
    ours, hf = pair
    if ours.chat_template is None:  # both refuse a chat without a template
        for tokenizer in (ours, hf):
            with pytest.raises(ValueError, match=r"chat[ _]template"):
                tokenizer.apply_chat_template(CONVERSATIONS[0], tokenize=False)
        return
    for tools in (None, TOOLS):
        for messages in CONVERSATIONS:
            kwargs = {"tools": tools, "add_generation_prompt": add_generation_prompt}
            want = hf.apply_chat_template(messages, tokenize=False, **kwargs)
            assert ours.apply_chat_template(messages, tokenize=False, **kwargs) == want
            assert ours.apply_chat_template(messages, **kwargs) == hf.apply_chat_template(
                messages, return_dict=False, **kwargs
            )


def test_a_template_error_is_the_one_transformers_raises(checkpoint_root: Path) -> None:
    path = hub.llama_spm(checkpoint_root / "llama2-errors")
    ours, hf = Tokenizer.from_dir(path), AutoTokenizer.from_pretrained(path)
    two_users = [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]
    with pytest.raises(jinja2.TemplateError) as theirs:
        hf.apply_chat_template(two_users, tokenize=False)
    with pytest.raises(jinja2.TemplateError, match="must alternate") as mine:
        ours.apply_chat_template(two_users, tokenize=False)
    assert str(mine.value) == str(theirs.value)
    ours.chat_template = "{{ ''.__class__.__mro__ }}"
    with pytest.raises(jinja2.exceptions.SecurityError):
        ours.apply_chat_template(two_users, tokenize=False)


def test_xgrammar_sees_our_tokenizer_as_it_sees_transformers(pair: tuple[Tokenizer, Any]) -> None:
    ours, hf = pair
    size = max(hf.get_vocab().values()) + 1
    mine, theirs = tokenizer_info(ours, size, None), tokenizer_info(hf, size, None)
    assert mine.decoded_vocab == theirs.decoded_vocab
    assert (mine.vocab_type, mine.add_prefix_space, mine.vocab_size) == (
        theirs.vocab_type, theirs.add_prefix_space, theirs.vocab_size,
    )  # fmt: skip
    assert (mine.stop_token_ids, mine.special_token_ids) == (
        theirs.stop_token_ids, theirs.special_token_ids,
    )  # fmt: skip
    schema = json.dumps({"type": "object", "properties": {"city": {"type": "string"}}})
    matchers = [
        xgr.GrammarMatcher(xgr.GrammarCompiler(info).compile_json_schema(schema))
        for info in (mine, theirs)
    ]
    masks = [xgr.allocate_token_bitmask(1, size) for _ in matchers]
    for _ in range(6):  # the first allowed token each step
        for matcher, mask in zip(matchers, masks, strict=True):
            matcher.fill_next_token_bitmask(mask, 0)
        assert torch.equal(masks[0], masks[1])
        bits = np.unpackbits(masks[0][0].numpy().view(np.uint8), bitorder="little")[:size]
        if not bits.any():
            break
        first = int(np.flatnonzero(bits)[0])
        for matcher in matchers:
            assert matcher.accept_token(first)


def test_loading_a_tokenizer_imports_neither_torch_nor_transformers() -> None:
    # The ingress's path: its module, the model name resolved as workers do, a chat prompt.
    program = (
        "import sys\n"
        "from pagefleet.cluster.prompts import load_tokenizer\n"
        "from pagefleet.worker.chat import chat_prompt\n"
        "tiny = load_tokenizer('tiny')\n"
        "assert tiny.encode('hello') and tiny.decode(tiny.encode('hi'), skip_special_tokens=True) == 'hi'\n"
        "assert chat_prompt([{'role': 'user', 'content': 'hi'}], tiny)\n"
        "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", program], capture_output=True, text=True, check=True,
        env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent.parent)},
    )  # fmt: skip
    assert out.stdout.strip() == "[]", out.stderr


def test_a_chat_template_renders_without_torch_or_transformers(checkpoint_root: Path) -> None:
    path = hub.qwen2_style(checkpoint_root / "qwen2.5-no-torch")
    program = (
        "import sys\n"
        "from pathlib import Path\n"
        "from pagefleet.worker.model_files import load_tokenizer\n"
        f"tokenizer = load_tokenizer(Path({str(path)!r}))\n"
        f"tools = {TOOLS!r}\n"
        "ids = tokenizer.apply_chat_template([{'role': 'user', 'content': 'hi'}], tools=tools)\n"
        "assert tokenizer.decode(ids).startswith('<|im_start|>system')\n"
        "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", program], capture_output=True, text=True, check=True,
        env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent.parent)},
    )  # fmt: skip
    assert out.stdout.strip() == "[]", out.stderr


def test_an_unreadable_tokenizer_file_is_a_model_file_error_naming_it(tmp_path: Path) -> None:
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(ModelFileError, match=r"cannot load the tokenizer: tokenizer\.json: "):
        load_tokenizer(tmp_path)
    hub.wordpiece(tmp_path / "w")
    (tmp_path / "w" / "tokenizer_config.json").write_text("[1, 2]")
    with pytest.raises(ModelFileError, match=r"tokenizer_config\.json: not a JSON object"):
        load_tokenizer(tmp_path / "w")
    (tmp_path / "w" / "tokenizer_config.json").write_text(
        '{"added_tokens_decoder": {"5": {"content": 5}}}'
    )
    with pytest.raises(ModelFileError, match=r"tokenizer_config\.json: TypeError"):
        load_tokenizer(tmp_path / "w")


def test_a_vocab_json_alone_names_tokenizer_json(tmp_path: Path) -> None:
    (tmp_path / "vocab.json").write_text("{}")
    with pytest.raises(ModelFileError, match=r"tokenizer\.json is missing \(only vocab\.json"):
        load_tokenizer(tmp_path)


def test_a_copy_takes_its_own_chat_template(pair: tuple[Tokenizer, Any]) -> None:
    ours, _ = pair
    copied = copy.deepcopy(ours)
    copied.chat_template = "{% for m in messages %}{{ m.content }}|{% endfor %}"
    assert copied.apply_chat_template(CONVERSATIONS[1], tokenize=False) == "Be brief.|Hi there |"
    assert copied.encode("Hello world") == ours.encode("Hello world")
    assert ours.chat_template != copied.chat_template

"""Tokenizer directories shaped like the Hub's, built offline, for comparing our tokenizer
with transformers' (`tests/test_tokenizer.py`).

Each builder trains a small vocabulary on the tiny model's corpus with `tokenizers` and
writes `tokenizer.json`, `tokenizer_config.json` and a `config.json` naming the model
type (which picks transformers' tokenizer class), as the Hub's checkpoints of that
family have them:

- `llama_spm`: Llama 2 / TinyLlama (sentencepiece BPE with byte fallback,
  `LlamaTokenizerFast`, `add_bos_token`, `legacy`), in the current tokenizer.json
  format or the older one (a normalizer instead of a Metaspace pre-tokenizer);
- `qwen2_style`: Qwen2.5 (NFC, Qwen's split, byte-level; a template that renders tools);
- `gpt2_style`: SmolLM2 as the Hub has it (`GPT2Tokenizer` on a llama model);
- `legacy_files`: the files of older checkpoints (`special_tokens_map.json`,
  `added_tokens.json`, no `added_tokens_decoder`; special tokens outside the
  vocabulary; named chat templates in the config);
- `wordpiece`: a WordPiece vocabulary with `clean_up_tokenization_spaces`; chat
  templates in files (`chat_template.jinja`, `additional_chat_templates/`).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tokenizers import (
    Regex,
    Tokenizer,
    decoders,
    models,
    normalizers,
    pre_tokenizers,
    processors,
    trainers,
)

from pagefleet.worker.tiny_model import corpus_text

SPIECE = "\u2581"

LLAMA2_TEMPLATE = (
    "{% if messages[0]['role'] == 'system' %}{% set loop_messages = messages[1:] %}"
    "{% set system_message = messages[0]['content'] %}{% else %}{% set loop_messages = messages %}"
    "{% set system_message = false %}{% endif %}{% for message in loop_messages %}"
    "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
    "{% endif %}{% if loop.index0 == 0 and system_message != false %}"
    "{% set content = '<<SYS>>\\n' + system_message + '\\n<</SYS>>\\n\\n' + message['content'] %}"
    "{% else %}{% set content = message['content'] %}{% endif %}"
    "{% if message['role'] == 'user' %}{{ bos_token + '[INST] ' + content.strip() + ' [/INST]' }}"
    "{% elif message['role'] == 'assistant' %}{{ ' ' + content.strip() + ' ' + eos_token }}"
    "{% endif %}{% endfor %}"
)

QWEN2_TEMPLATE = """{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0]['role'] == 'system' %}
        {{- messages[0]['content'] }}
    {%- else %}
        {{- 'You are a helpful assistant.' }}
    {%- endif %}
    {{- "\\n\\n# Tools\\n\\n<tools>" }}
    {%- for tool in tools %}
        {{- "\\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\\n</tools><|im_end|>\\n" }}
{%- else %}
    {%- if messages[0]['role'] == 'system' %}
        {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}
    {%- else %}
        {{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}
    {%- endif %}
{%- endif %}
{%- for message in messages %}
    {%- if message.role == "system" and loop.first %}{% continue %}{% endif %}
    {%- if message.role == "tool" %}
        {{- '<|im_start|>user\\n<tool_response>\\n' + message.content + '\\n</tool_response><|im_end|>\\n' }}
    {%- else %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""

SMOLLM2_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging "
    "Face<|im_end|>\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content']"
    " + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|im_start|>assistant\n' }}{% endif %}"
)

# A template using what transformers' sandbox adds: namespace, loop controls, the
# generation tag, dict(), strftime_now, tojson with options, and the special tokens.
LEGACY_DEFAULT_TEMPLATE = """{%- set ns = namespace(count=0) -%}
{{ bos_token }}{{ strftime_now('%Y')[:0] }}
{%- for m in messages -%}
{%- if m.role == 'system' %}{% continue %}{% endif -%}
{%- set ns.count = ns.count + 1 -%}
{%- if m.role == 'assistant' -%}
{% generation %}{{ m.content }}{{ eos_token }}{% endgeneration %}
{%- else -%}
[{{ ns.count }}] {{ m.role }}: {{ m.content }} {{ dict(n=ns.count) | tojson(sort_keys=true) }}
{% endif -%}
{%- if ns.count > 5 %}{% break %}{% endif -%}
{%- endfor -%}
{%- if add_generation_prompt %}{{ mask_token }} {{ image_token }}{% endif -%}
"""
LEGACY_TOOL_TEMPLATE = (
    "{% for t in tools %}tool {{ t.function.name }}: {{ t.function | tojson(indent=2) }}\n"
    "{% endfor %}{% for m in messages %}{{ m.role }}> {{ m.content }}\n{% endfor %}"
)

WORDPIECE_TEMPLATE = (
    "{% for m in messages %}{{ cls_token }} {{ m.content }} {{ sep_token }}{% endfor %}"
)


def _train(
    pre_tokenizer: Any,
    decoder: Any,
    vocab_size: int,
    special_tokens: list[str],
    normalizer: Any = None,
    byte_level: bool = False,
) -> Tokenizer:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.normalizer = normalizer
    tokenizer.pre_tokenizer = pre_tokenizer
    tokenizer.decoder = decoder
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=special_tokens,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet() if byte_level else [],
        show_progress=False,
    )
    tokenizer.train_from_iterator(corpus_text().splitlines(keepends=True), trainer=trainer)
    return tokenizer


def _added(tokenizer: Tokenizer, tokens: list[str], special: bool = True) -> dict[str, Any]:
    """tokenizer_config.json's `added_tokens_decoder` for `tokens`."""
    return {
        str(tokenizer.token_to_id(t)): {
            "content": t, "lstrip": False, "normalized": not special, "rstrip": False,
            "single_word": False, "special": special,
        }
        for t in tokens
    }  # fmt: skip


def _write(
    out: Path, tokenizer: Tokenizer, config: dict[str, Any], model_type: str, **files: Any
) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    (out / "config.json").write_text(json.dumps({"model_type": model_type}))
    for name, content in files.items():
        (out / f"{name}.json").write_text(json.dumps(content, indent=2))
    return out


def llama_spm(out: Path, old_format: bool = False, **config: Any) -> Path:
    """A Llama 2 shaped checkpoint; `config` overrides tokenizer_config.json entries."""
    metaspace = pre_tokenizers.Metaspace(replacement=SPIECE, prepend_scheme="first", split=False)
    trained = json.loads(_train(metaspace, None, 600, ["<unk>", "<s>", "</s>"]).to_str())["model"]
    # Llama's layout: <unk> <s> </s>, the 256 byte pieces, then the merged pieces.
    order = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    order += [
        t for t, _ in sorted(trained["vocab"].items(), key=lambda kv: kv[1]) if t not in order
    ]
    tokenizer = Tokenizer(
        models.BPE(
            vocab={t: i for i, t in enumerate(order)},
            merges=[tuple(m) if isinstance(m, list) else tuple(m.split(" ")) for m in trained["merges"]],
            unk_token="<unk>", fuse_unk=True, byte_fallback=True,
        )
    )  # fmt: skip
    if old_format:  # what the Hub's Llama 2 and TinyLlama files still have
        tokenizer.normalizer = normalizers.Sequence(
            [normalizers.Prepend(SPIECE), normalizers.Replace(" ", SPIECE)]
        )
        tokenizer.pre_tokenizer = None
    else:
        tokenizer.pre_tokenizer = metaspace
    tokenizer.decoder = decoders.Sequence(
        [decoders.Replace(SPIECE, " "), decoders.ByteFallback(), decoders.Fuse(),
         decoders.Strip(" ", 1, 0)]
    )  # fmt: skip
    tokenizer.add_special_tokens(["<unk>", "<s>", "</s>"])
    tokenizer.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", 1)]
    )
    settings = {
        "add_bos_token": True, "add_eos_token": False,
        "added_tokens_decoder": _added(tokenizer, ["<unk>", "<s>", "</s>"]),
        "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>", "pad_token": None,
        "clean_up_tokenization_spaces": False, "legacy": False, "model_max_length": 4096,
        "sp_model_kwargs": {}, "tokenizer_class": "LlamaTokenizerFast",
        "chat_template": LLAMA2_TEMPLATE, **config,
    }  # fmt: skip
    return _write(out, tokenizer, settings, "llama")


def qwen2_style(out: Path) -> Path:
    """A Qwen2.5 shaped checkpoint."""
    special = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    split = pre_tokenizers.Split(
        Regex(
            r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
            r"""|\s*[\r\n]+|\s+(?!\S)|\s+"""
        ),
        behavior="isolated",
        invert=False,
    )
    tokenizer = _train(
        pre_tokenizers.Sequence(
            [split, pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
        ),
        decoders.ByteLevel(),
        700,
        [],
        normalizer=normalizers.NFC(),
        byte_level=True,
    )
    tokenizer.add_special_tokens(special)
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    settings = {
        "add_bos_token": False, "add_prefix_space": False,
        "added_tokens_decoder": _added(tokenizer, special),
        "additional_special_tokens": ["<|im_start|>", "<|im_end|>"],
        "bos_token": None, "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>",
        "unk_token": None, "errors": "replace", "split_special_tokens": False,
        "clean_up_tokenization_spaces": False, "model_max_length": 131072,
        "tokenizer_class": "Qwen2Tokenizer", "chat_template": QWEN2_TEMPLATE,
    }  # fmt: skip
    return _write(out, tokenizer, settings, "qwen2")


def gpt2_style(out: Path) -> Path:
    """SmolLM2 as the Hub has it: a byte-level BPE named GPT2Tokenizer, on a llama model."""
    special = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<repo_name>"]
    tokenizer = _train(
        pre_tokenizers.ByteLevel(add_prefix_space=False),
        decoders.ByteLevel(),
        700,
        special,
        byte_level=True,
    )
    tokenizer.post_processor = processors.TemplateProcessing(single="$A", pair="$A $B:1")
    settings = {
        "add_prefix_space": False, "added_tokens_decoder": _added(tokenizer, special),
        "additional_special_tokens": ["<|im_start|>", "<|im_end|>"],
        "bos_token": "<|im_start|>", "eos_token": "<|im_end|>", "pad_token": "<|im_end|>",
        "unk_token": "<|endoftext|>", "clean_up_tokenization_spaces": False,
        "model_max_length": 8192, "vocab_size": 49152, "tokenizer_class": "GPT2Tokenizer",
        "chat_template": SMOLLM2_TEMPLATE,
    }  # fmt: skip
    return _write(out, tokenizer, settings, "llama")


def legacy_files(out: Path) -> Path:
    """Older files: special tokens in special_tokens_map.json (two outside the
    vocabulary), added_tokens.json, named chat templates."""
    tokenizer = _train(
        pre_tokenizers.ByteLevel(add_prefix_space=True),
        decoders.ByteLevel(),
        500,
        ["<|endoftext|>"],
        byte_level=True,
    )
    tokenizer.add_tokens(["<note>"])  # an added token that is not special
    settings = {
        "model_max_length": 1024, "clean_up_tokenization_spaces": True,
        "tokenizer_class": "PreTrainedTokenizerFast", "image_token": "<image>",
        "chat_template": [
            {"name": "default", "template": LEGACY_DEFAULT_TEMPLATE},
            {"name": "tool_use", "template": LEGACY_TOOL_TEMPLATE},
        ],
    }  # fmt: skip
    token = {"lstrip": False, "normalized": False, "rstrip": False, "single_word": False}
    special_tokens_map = {
        "bos_token": {"content": "<|endoftext|>", **token},
        "eos_token": "<|endoftext|>",
        "mask_token": {"content": "<mask>", **token, "lstrip": True},
        "additional_special_tokens": ["<extra>"],
    }
    return _write(
        out, tokenizer, settings, "mistral",
        special_tokens_map=special_tokens_map, added_tokens={"<note>": tokenizer.token_to_id("<note>")},
    )  # fmt: skip


def wordpiece(out: Path) -> Path:
    """A WordPiece vocabulary (BERT's shape) whose decode cleans up spaces."""
    special = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    tokenizer = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tokenizer.normalizer = normalizers.BertNormalizer(lowercase=True)
    tokenizer.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    # The decoder's own clean-up off: transformers' (configured below) does it.
    tokenizer.decoder = decoders.WordPiece(cleanup=False)
    trainer = trainers.WordPieceTrainer(vocab_size=600, special_tokens=special, show_progress=False)
    tokenizer.train_from_iterator(corpus_text().splitlines(), trainer=trainer)
    tokenizer.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]",
        pair="[CLS] $A [SEP] $B:1 [SEP]:1",
        special_tokens=[
            ("[CLS]", tokenizer.token_to_id("[CLS]")),
            ("[SEP]", tokenizer.token_to_id("[SEP]")),
        ],
    )
    names = ("pad_token", "unk_token", "cls_token", "sep_token", "mask_token")
    settings = {
        "added_tokens_decoder": _added(tokenizer, special), "clean_up_tokenization_spaces": True,
        "model_max_length": 512, "tokenizer_class": "PreTrainedTokenizerFast",
        **dict(zip(names, special, strict=True)),
    }  # fmt: skip
    out = _write(out, tokenizer, settings, "mistral")
    # Templates in files, as transformers 5 saves them: a default and a named one.
    (out / "chat_template.jinja").write_text(WORDPIECE_TEMPLATE)
    (out / "additional_chat_templates").mkdir()
    (out / "additional_chat_templates" / "tool_use.jinja").write_text(LEGACY_TOOL_TEMPLATE)
    return out

"""A checkpoint's tokenizer, read as transformers reads it, without importing transformers.

`AutoTokenizer.from_pretrained` imports torch and much of transformers'
modeling code: about 2.5 CPU-seconds that every ingress replica and every
worker paid at start, for a tokenizer that is `tokenizers` (Rust) underneath.
`Tokenizer` is that Rust tokenizer plus what transformers 5 does on top,
repeated call for call on the same `tokenizers` objects so the ids come out
the same:

- `tokenizer.json` is the pipeline; its post-processor alone adds BOS/EOS
  (transformers drops `add_bos_token`/`add_eos_token` from the config when a
  `tokenizer.json` is there), and encoding never truncates nor pads;
- the special tokens of `tokenizer_config.json` (or of the legacy
  `special_tokens_map.json` / `added_tokens.json`) are added to the Rust
  tokenizer in transformers' order, so a special token missing from the
  vocabulary gets the id transformers gives it;
- for the architectures pagefleet serves, the model-specific class
  `AutoTokenizer` picks rebuilds the pipeline from the vocabulary with that
  model's defaults, and so does `_model_class`: `Qwen2Tokenizer` for every
  `model_type: qwen2`; for `llama`, `LlamaTokenizer` (a Metaspace pipeline
  whose prefix space follows the config's `legacy`) or `GPT2Tokenizer` where
  the config names them; a `mistral` checkpoint reads as it is;
- `decode` cleans up tokenization spaces only where transformers does (never
  for BPE);
- chat templates (`chat_template.jinja`, `additional_chat_templates/`, or the
  config's `chat_template`) render in transformers' sandbox
  (`pagefleet.worker.chat_template`), the special tokens as variables.

Not followed: the other model-specific classes (model types pagefleet does
not serve: their tokenizer.json is read as it is), remote code (`auto_map`),
`mistral_common` (not installed with pagefleet), the opt-in
`fix_mistral_regex`, and a tokenizer without `tokenizer.json` (a
sentencepiece model or `vocab.json` alone: `load_tokenizer` refuses it).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers, processors
from tokenizers import Tokenizer as RustTokenizer

from pagefleet.worker.chat_template import render_chat_template

TOKENIZER_FILE = "tokenizer.json"
CONFIG_FILE = "tokenizer_config.json"
MODEL_CONFIG_FILE = "config.json"  # its model_type picks transformers' tokenizer class
SPECIAL_TOKENS_MAP_FILE = "special_tokens_map.json"  # legacy, read without added_tokens_decoder
ADDED_TOKENS_FILE = "added_tokens.json"  # legacy, likewise
CHAT_TEMPLATE_FILE = "chat_template.jinja"
CHAT_TEMPLATE_DIR = "additional_chat_templates"

# The named special tokens of transformers' tokenizers, in its order (the order new
# special tokens get their ids in).
NAMED_SPECIAL_TOKENS = (
    "bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token",
)  # fmt: skip
# transformers' model_max_length when the config gives none: "no limit known".
VERY_LARGE_INTEGER = int(1e30)

Token = str | AddedToken


class Tokenizer:
    """A checkpoint directory's tokenizer (`Tokenizer.from_dir`), with the part of
    transformers' tokenizer API that pagefleet uses; ids, text and chat prompts equal
    `AutoTokenizer`'s (see the module docstring for where they may not)."""

    def __init__(
        self,
        backend: RustTokenizer,
        special_tokens: Mapping[str, str],
        chat_template: str | dict[str, str] | None = None,
        model_max_length: int = VERY_LARGE_INTEGER,
        clean_up_tokenization_spaces: bool = False,
    ) -> None:
        """`backend` as transformers leaves it after loading; `special_tokens` maps the
        named special tokens (`eos_token`, ..., and model-specific ones) to their text;
        `clean_up_tokenization_spaces`: whether `decode` cleans up spaces before
        punctuation (transformers' setting, already off for BPE)."""
        self.backend_tokenizer = backend
        self.special_tokens_map = dict(special_tokens)
        self.chat_template = chat_template
        self.model_max_length = model_max_length
        self.clean_up_tokenization_spaces = clean_up_tokenization_spaces

    @classmethod
    def from_dir(cls, path: Path) -> Tokenizer:
        """The tokenizer of a checkpoint directory with a `tokenizer.json`; ValueError
        naming the file that cannot be read."""
        file = path / TOKENIZER_FILE
        try:
            backend = RustTokenizer.from_file(str(file))
        except Exception as exc:  # tokenizers raises a bare Exception on a bad file
            raise ValueError(f"{file.name}: {_first_line(exc)}") from exc
        config_file = path / CONFIG_FILE
        config = _read_json(config_file) if config_file.is_file() else {}
        try:
            model_class = _model_class(path, config, backend)
            kwargs = _init_kwargs(path, dict(config), backend)
            for key, value in (model_class.defaults if model_class else {}).items():
                kwargs.setdefault(key, value)
            if backend.padding is not None:
                kwargs.setdefault("pad_token", backend.padding["pad_token"])
            if model_class is not None:
                backend = model_class.rebuild(backend, kwargs)
            readds = bool(model_class and model_class.readds)
            return _load(backend, kwargs, readd_special_tokens=readds)
        except (TypeError, KeyError, AttributeError) as exc:  # a config of the wrong shape
            raise ValueError(f"{CONFIG_FILE}: {type(exc).__name__}: {exc}") from exc

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text` (with the post-processor's BOS/EOS when `add_special_tokens`)."""
        return list(self.backend_tokenizer.encode(text, add_special_tokens=add_special_tokens).ids)

    def decode(self, token_ids: int | Sequence[int], skip_special_tokens: bool = False) -> str:
        """The text of `token_ids` (special tokens left out when `skip_special_tokens`)."""
        ids = [token_ids] if isinstance(token_ids, int) else [int(t) for t in token_ids]
        text = str(self.backend_tokenizer.decode(ids, skip_special_tokens=skip_special_tokens))
        return _clean_up_tokenization(text) if self.clean_up_tokenization_spaces else text

    def get_vocab(self) -> dict[str, int]:
        """Every token (added tokens included) to its id."""
        return dict(self.backend_tokenizer.get_vocab(with_added_tokens=True))

    def convert_tokens_to_ids(self, tokens: str | Sequence[str]) -> Any:
        """The id of a token (or a list of ids of tokens); the unknown token's id (or
        None) for a token outside the vocabulary."""
        if isinstance(tokens, str):
            return self._token_id(tokens)
        return [self._token_id(t) for t in tokens]

    def _token_id(self, token: str) -> int | None:
        found = self.backend_tokenizer.token_to_id(token)
        if found is not None:
            return int(found)
        unk = self.special_tokens_map.get("unk_token")
        return None if unk is None else self.backend_tokenizer.token_to_id(unk)

    def _special_token_id(self, name: str) -> int | None:
        token = self.special_tokens_map.get(name)
        return None if token is None else self._token_id(token)

    @property
    def bos_token(self) -> str | None:
        return self.special_tokens_map.get("bos_token")

    @property
    def eos_token(self) -> str | None:
        return self.special_tokens_map.get("eos_token")

    @property
    def pad_token(self) -> str | None:
        return self.special_tokens_map.get("pad_token")

    @property
    def bos_token_id(self) -> int | None:
        return self._special_token_id("bos_token")

    @property
    def eos_token_id(self) -> int | None:
        return self._special_token_id("eos_token")

    @property
    def pad_token_id(self) -> int | None:
        return self._special_token_id("pad_token")

    def apply_chat_template(
        self,
        conversation: Sequence[Mapping[str, Any]],
        tools: Sequence[Mapping[str, Any]] | None = None,
        add_generation_prompt: bool = False,
        tokenize: bool = True,
        **template_kwargs: Any,
    ) -> str | list[int]:
        """A conversation rendered by the chat template: its token ids (as transformers'
        `return_dict=False`), or the text with `tokenize=False`. `tools` are JSON schemas
        (`{"type": "function", "function": {...}}`); `template_kwargs` are more template
        variables. Raises ValueError without a chat template, and the template's own
        jinja2 errors."""
        if not conversation:
            raise ValueError("Cannot apply chat template to an empty conversation.")
        text = render_chat_template(
            self._template_source(tools is not None),
            conversation,
            tools,
            add_generation_prompt,
            {**self.special_tokens_map, **template_kwargs},
        )
        return self.encode(text, add_special_tokens=False) if tokenize else text

    def _template_source(self, with_tools: bool) -> str:
        """The template transformers' `get_chat_template` picks."""
        template = self.chat_template
        if isinstance(template, dict):
            if with_tools and "tool_use" in template:
                return template["tool_use"]
            if "default" in template:
                return template["default"]
            raise ValueError(
                f"this model has several chat templates and none named default: {sorted(template)}"
            )
        if template is None:
            raise ValueError("this tokenizer has no chat template")
        return template


# ----- loading, in the order of transformers' `_from_pretrained` and `__init__`s ---------


def _init_kwargs(path: Path, kwargs: dict[str, Any], backend: RustTokenizer) -> dict[str, Any]:
    """The config (`tokenizer_config.json`) as transformers' `_from_pretrained` hands it
    to the tokenizer class."""
    kwargs.pop("tokenizer_class", None)
    kwargs.pop("init_inputs", None)
    # With a tokenizer.json its post-processor alone decides BOS and EOS.
    kwargs.pop("add_bos_token", None)
    kwargs.pop("add_eos_token", None)
    templates = _chat_template_files(path)
    if templates is not None:
        kwargs["chat_template"] = templates
    if "additional_special_tokens" in kwargs and not kwargs.get("extra_special_tokens"):
        kwargs["extra_special_tokens"] = kwargs.pop("additional_special_tokens")
    model_specific = {
        key: kwargs.pop(key)
        for key in list(kwargs)
        if key not in NAMED_SPECIAL_TOKENS
        and key.endswith("_token")
        and isinstance(kwargs[key], (str, AddedToken))
    }
    if isinstance(kwargs.get("extra_special_tokens"), dict):
        model_specific.update(kwargs.pop("extra_special_tokens"))
    if model_specific:
        kwargs["model_specific_special_tokens"] = model_specific

    added: dict[int, AddedToken] = {}
    by_text: dict[str, AddedToken] = {}
    if "added_tokens_decoder" in kwargs:
        for index, token in kwargs["added_tokens_decoder"].items():
            token = AddedToken(**token) if isinstance(token, dict) else token
            if not isinstance(token, AddedToken):
                raise ValueError(f"{CONFIG_FILE}: added_tokens_decoder[{index}] is not a token")
            added[int(index)] = by_text[str(token)] = token
    else:
        _read_legacy_special_tokens(path, kwargs)
        special = {str(kwargs[k]) for k in NAMED_SPECIAL_TOKENS if kwargs.get(k)}
        special.update(str(t) for t in kwargs.get("extra_special_tokens") or [])
        added_file = path / ADDED_TOKENS_FILE
        for text, index in (_read_json(added_file) if added_file.is_file() else {}).items():
            is_special = text in special
            token = AddedToken(
                text, rstrip=False, lstrip=False, normalized=not is_special, special=is_special
            )
            added[int(index)] = by_text[text] = token
        for index, token in backend.get_added_tokens_decoder().items():
            added[int(index)] = by_text[str(token)] = _copy_token(token)
    kwargs["added_tokens_decoder"] = added
    kwargs = _added_tokens_in(kwargs)
    for key in NAMED_SPECIAL_TOKENS:
        if kwargs.get(key) is not None and by_text:
            kwargs[key] = by_text.get(str(kwargs[key]), kwargs[key])
    return kwargs


def _read_legacy_special_tokens(path: Path, kwargs: dict[str, Any]) -> None:
    """Merge `special_tokens_map.json` into `kwargs` (it wins over the config)."""
    file = path / SPECIAL_TOKENS_MAP_FILE
    if not file.is_file():
        return
    for key, value in _read_json(file).items():
        if isinstance(value, dict) and key != "extra_special_tokens":
            value.pop("special", None)
            value = AddedToken(**value, special=True)
        elif key == "extra_special_tokens" and isinstance(value, list):
            merged = list(kwargs.get("extra_special_tokens") or [])
            for token in value:
                token = AddedToken(**token, special=True) if isinstance(token, dict) else token
                if token not in merged:
                    merged.append(token)
            value = merged
        kwargs[key] = value
    if isinstance(kwargs.get("extra_special_tokens"), dict):
        kwargs.setdefault("model_specific_special_tokens", {}).update(
            kwargs.pop("extra_special_tokens")
        )


def _load(
    backend: RustTokenizer, kwargs: dict[str, Any], readd_special_tokens: bool = False
) -> Tokenizer:
    """What `TokenizersBackend.__init__` (and the base class's) do with the kwargs;
    `readd_special_tokens`: add every special token once more at the end (as
    `Qwen2Tokenizer` does)."""
    # transformers' encode turns both off (for good) on its first call.
    backend.no_truncation()
    backend.no_padding()
    if "additional_special_tokens" in kwargs and "extra_special_tokens" not in kwargs:
        kwargs["extra_special_tokens"] = kwargs.pop("additional_special_tokens")
    named: dict[str, Token | None] = dict.fromkeys(NAMED_SPECIAL_TOKENS)
    extra: list[Token] = []
    explicit = kwargs.pop("model_specific_special_tokens", None) or {}
    auto: dict[str, Token] = {}
    for key in list(kwargs):
        value = kwargs[key]
        if key in NAMED_SPECIAL_TOKENS:
            kwargs.pop(key)
            if value is not None:
                named[key] = _token(key, value)
        elif key == "extra_special_tokens":
            kwargs.pop(key)
            if isinstance(value, dict):
                named.update({k: _token(k, v) for k, v in value.items()})
            elif isinstance(value, (list, tuple)):
                extra = list(value)
            elif value is not None:
                raise ValueError(f"{CONFIG_FILE}: extra_special_tokens must be a list or a dict")
        elif key.endswith("_token") and isinstance(value, (str, AddedToken)):
            auto[key] = kwargs.pop(key)
    named.update({k: _token(k, v) for k, v in {**auto, **explicit}.items()})
    chat_template = kwargs.get("chat_template")
    if isinstance(chat_template, (list, tuple)):
        chat_template = {t["name"]: t["template"] for t in chat_template}
    max_len = kwargs.get("model_max_length", kwargs.get("max_len"))
    backend.encode_special_tokens = bool(kwargs.get("split_special_tokens", False))

    # transformers adds every token of the config's added_tokens_decoder again (the
    # check meant to skip those already there compares an id's repr with a token's),
    # then each special token the tokenizer does not know yet: an identical token is
    # a no-op, a differing one replaces the entry, a new one gets the next id.
    to_add: list[Token] = [token for _, token in sorted(kwargs["added_tokens_decoder"].items())]
    known = [t.content for _, t in sorted(backend.get_added_tokens_decoder().items())]
    known += [str(t) for t in to_add]
    for token in [t for t in named.values() if t is not None] + extra:
        if str(token) not in known and token not in to_add:
            to_add.append(token)
    if to_add:
        named_texts = [str(t) for t in named.values() if t]
        tokens: list[AddedToken] = []
        for token in to_add:
            if isinstance(token, str):
                token = AddedToken(token, special=True)
            elif not token.special and str(token) in named_texts:
                token.special = True
            tokens.append(token)
        backend.add_tokens(tokens)
    if readd_special_tokens:
        texts = dict.fromkeys(str(t) for t in [*named.values(), *extra] if t is not None)
        backend.add_tokens([AddedToken(text, special=True) for text in texts])
    if backend.post_processor is None:  # transformers writes an empty template
        backend.post_processor = processors.TemplateProcessing(
            single="$A:0", pair="$A:0 $B:1", special_tokens=[]
        )
    return Tokenizer(
        backend,
        {name: str(token) for name, token in named.items() if token is not None},
        chat_template=chat_template,
        model_max_length=VERY_LARGE_INTEGER if max_len is None else max_len,
        clean_up_tokenization_spaces=_cleans_up(backend, kwargs),
    )


def _cleans_up(backend: RustTokenizer, kwargs: Mapping[str, Any]) -> bool:
    """Whether decode cleans up tokenization spaces: as configured, but never for BPE
    (transformers skips it there: it would delete real spaces before punctuation),
    unless the config insists."""
    if not kwargs.get("clean_up_tokenization_spaces", False):
        return False
    force = "clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output"
    return type(backend.model).__name__ != "BPE" or bool(kwargs.get(force, False))


def _clean_up_tokenization(text: str) -> str:
    return (
        text.replace(" .", ".").replace(" ?", "?").replace(" !", "!").replace(" ,", ",")
        .replace(" ' ", "'").replace(" n't", "n't").replace(" 'm", "'m").replace(" 's", "'s")
        .replace(" 've", "'ve").replace(" 're", "'re")
    )  # fmt: skip


def _token(name: str, value: Any) -> Token:
    if not isinstance(value, (str, AddedToken)):
        raise ValueError(f"{CONFIG_FILE}: {name} must be a string or an AddedToken")
    return value


def _copy_token(token: AddedToken) -> AddedToken:
    return AddedToken(**token.__getstate__())


def _added_tokens_in(value: Any) -> Any:
    """`value` with every `{"__type": "AddedToken", ...}` dict in it made an AddedToken."""
    if isinstance(value, dict) and value.get("__type") == "AddedToken":
        return AddedToken(**{k: v for k, v in value.items() if k != "__type"})
    if isinstance(value, (list, tuple)):
        return [_added_tokens_in(v) for v in value]
    if isinstance(value, dict):
        return {k: _added_tokens_in(v) for k, v in value.items()}
    return value


def _chat_template_files(path: Path) -> str | dict[str, str] | None:
    """The chat templates in files (they win over the config's): one text, several by name,
    or None."""
    templates: dict[str, str] = {}
    if (path / CHAT_TEMPLATE_FILE).is_file():
        templates["default"] = _read_text(path / CHAT_TEMPLATE_FILE)
    if (path / CHAT_TEMPLATE_DIR).is_dir():
        for file in sorted((path / CHAT_TEMPLATE_DIR).glob("*.jinja")):
            templates[file.name.removesuffix(".jinja")] = _read_text(file)
    if list(templates) == ["default"]:
        return templates["default"]
    return templates or None


# ----- the model-specific classes AutoTokenizer picks for pagefleet's architectures -------


@dataclass(frozen=True)
class ModelClass:
    """What one of transformers' model-specific tokenizer classes does differently from
    `TokenizersBackend`: it builds its own pipeline around tokenizer.json's vocabulary
    and merges (keeping only its post-processor), with its own defaults for the config."""

    name: str
    # (vocab, merges, config) -> the Rust tokenizer the class's __init__ builds
    pipeline: Callable[[dict[str, int], list[tuple[str, str]], Mapping[str, Any]], RustTokenizer]
    defaults: Mapping[str, Any] = field(default_factory=dict)  # its __init__'s defaults
    readds: bool = False  # adds every special token once more after init

    def rebuild(self, backend: RustTokenizer, kwargs: Mapping[str, Any]) -> RustTokenizer:
        """The class's pipeline in place of `backend`'s."""
        model = json.loads(backend.to_str())["model"]
        merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in model["merges"]]
        rebuilt = self.pipeline(model["vocab"], merges, kwargs)  # type: ignore[arg-type]
        rebuilt.post_processor = backend.post_processor
        return rebuilt


def _llama_pipeline(
    vocab: dict[str, int], merges: list[tuple[str, str]], config: Mapping[str, Any]
) -> RustTokenizer:
    prefix_space = config.get("add_prefix_space")
    prefix_space = True if prefix_space is None else bool(prefix_space)
    scheme = ("always" if config.get("legacy", False) else "first") if prefix_space else "never"
    tokenizer = RustTokenizer(
        models.BPE(vocab=vocab, merges=merges, fuse_unk=True, byte_fallback=True, dropout=None)
    )
    tokenizer.normalizer = None
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(
        replacement="\u2581", prepend_scheme=scheme, split=False
    )
    steps = [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
    if prefix_space:
        steps.append(decoders.Strip(content=" ", left=1))
    tokenizer.decoder = decoders.Sequence(steps)
    return tokenizer


# Qwen2Tokenizer's pre-tokenizing split (transformers' PRETOKENIZE_REGEX).
QWEN2_SPLIT = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
    r"""|\s*[\r\n]+|\s+(?!\S)|\s+"""
)


def _qwen2_pipeline(
    vocab: dict[str, int], merges: list[tuple[str, str]], config: Mapping[str, Any]
) -> RustTokenizer:
    tokenizer = RustTokenizer(
        models.BPE(
            vocab=vocab, merges=merges, dropout=None, unk_token=None, continuing_subword_prefix="",
            end_of_word_suffix="", fuse_unk=False, byte_fallback=False,
        )
    )  # fmt: skip
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN2_SPLIT), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(
                add_prefix_space=bool(config.get("add_prefix_space") or False), use_regex=False
            ),
        ]
    )
    return tokenizer


def _gpt2_pipeline(
    vocab: dict[str, int], merges: list[tuple[str, str]], config: Mapping[str, Any]
) -> RustTokenizer:
    tokenizer = RustTokenizer(
        models.BPE(
            vocab=vocab, merges=merges, dropout=None, continuing_subword_prefix="",
            end_of_word_suffix="", fuse_unk=False,
        )
    )  # fmt: skip
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(
        add_prefix_space=bool(config.get("add_prefix_space", False))
    )
    tokenizer.decoder = decoders.ByteLevel()
    return tokenizer


ENDOFTEXT = "<|endoftext|>"
LLAMA = ModelClass(
    "LlamaTokenizer",
    _llama_pipeline,
    {"unk_token": "<unk>", "bos_token": "<s>", "eos_token": "</s>"},
)
QWEN2 = ModelClass(
    "Qwen2Tokenizer",
    _qwen2_pipeline,
    {"unk_token": ENDOFTEXT, "eos_token": ENDOFTEXT, "pad_token": ENDOFTEXT},
    readds=True,
)
GPT2 = ModelClass(
    "GPT2Tokenizer",
    _gpt2_pipeline,
    {"unk_token": ENDOFTEXT, "bos_token": ENDOFTEXT, "eos_token": ENDOFTEXT},
)


def _model_class(
    path: Path, config: Mapping[str, Any], backend: RustTokenizer
) -> ModelClass | None:
    """The model-specific class AutoTokenizer loads this checkpoint with, for the model
    types pagefleet serves (None: `TokenizersBackend`, tokenizer.json as it is)."""
    model_file = path / MODEL_CONFIG_FILE
    model_config = _read_json(model_file) if model_file.is_file() else {}
    model_type = model_config.get("model_type")
    declared = config.get("tokenizer_class") or model_config.get("tokenizer_class") or ""
    declared = str(declared).removesuffix("Fast")
    if "auto_map" in config or type(backend.model).__name__ != "BPE":
        return None  # remote code, or a vocabulary these classes would misread
    if model_type == "qwen2":  # transformers overrides the class the config names
        return QWEN2
    if model_type == "llama" and declared == GPT2.name:
        return GPT2
    if model_type == "llama" and declared == LLAMA.name:
        # A byte-level vocabulary (Llama 3 style) loads as TokenizersBackend instead.
        byte_level = '"ByteLevel"' in _read_text(path / TOKENIZER_FILE)
        return None if byte_level else LLAMA
    return None


# ----- files ------------------------------------------------------------------------------


def _read_text(file: Path) -> str:
    try:
        return file.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"{file.name}: {_first_line(exc)}") from exc


def _read_json(file: Path) -> dict[str, Any]:
    try:
        value = json.loads(_read_text(file))
    except json.JSONDecodeError as exc:
        raise ValueError(f"{file.name}: {exc}") from exc
    if not isinstance(value, dict):
        raise ValueError(f"{file.name}: not a JSON object")
    return value


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__

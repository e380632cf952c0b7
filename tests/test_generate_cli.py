"""`pagefleet generate`: offline streaming to stdout, and user errors as exit code 2."""

from __future__ import annotations

import pytest

from pagefleet.cli import main
from pagefleet.worker.llm import LLM
from pagefleet.worker.sampling_params import SamplingParams


def test_generate_prints_the_greedy_completion(capsys: pytest.CaptureFixture[str]) -> None:
    code = main(
        ["generate", "Once upon a time", "--model", "tiny", "--max-tokens", "12", "--ignore-eos"]
    )
    assert code == 0
    printed = capsys.readouterr().out
    expected = LLM(model="tiny", num_kv_blocks=16).generate(
        "Once upon a time", SamplingParams(max_tokens=12, ignore_eos=True)
    )[0].text
    assert printed == expected + "\n"
    assert expected.strip()


def test_generate_with_a_float16_kv_cache_prints_the_same_as_llm(
    capsys: pytest.CaptureFixture[str],
) -> None:
    args = ["generate", "Once upon a time", "--model", "tiny", "--max-tokens", "12", "--ignore-eos"]
    assert main([*args, "--kv-cache-dtype", "float16"]) == 0
    expected = LLM(model="tiny", num_kv_blocks=16, kv_cache_dtype="float16").generate(
        "Once upon a time", SamplingParams(max_tokens=12, ignore_eos=True)
    )[0].text
    assert capsys.readouterr().out == expected + "\n"


def test_bad_sampling_value_is_a_user_error(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["generate", "hi", "--temperature", "-1"]) == 2
    assert "temperature must be >= 0" in capsys.readouterr().err


def test_missing_model_directory_is_a_user_error(capsys: pytest.CaptureFixture[str], tmp_path) -> None:  # type: ignore[no-untyped-def]
    assert main(["generate", "hi", "--model", str(tmp_path / "nope")]) == 2
    assert "bad model" in capsys.readouterr().err


def test_unreachable_target_is_a_user_error(capsys: pytest.CaptureFixture[str]) -> None:
    # Port 1 on localhost: nothing listens, so the call fails fast with UNAVAILABLE.
    assert main(["generate", "hi", "--target", "127.0.0.1:1"]) == 2
    assert "127.0.0.1:1: UNAVAILABLE" in capsys.readouterr().err

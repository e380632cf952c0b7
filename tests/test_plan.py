"""`pagefleet plan` and the capacity arithmetic behind it."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from pagefleet.cli import main
from pagefleet.worker.capacity import CapacityPlan
from pagefleet.worker.config import EngineConfig
from pagefleet.worker.kv_cache import ModelShape, parse_dtype
from pagefleet.worker.sizes import format_bytes, parse_bytes

# A Llama-3-8B-like shape: 32 layers, 8 KV heads of 128 -> 128 KiB per fp16 token.
CONFIG = {
    "model_type": "llama",
    "hidden_size": 4096,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "num_hidden_layers": 32,
    "max_position_embeddings": 4096,
}
BYTES_PER_TOKEN = 32 * 8 * 128 * 2 * 2


@pytest.fixture
def config_json(tmp_path: Path) -> Path:
    path = tmp_path / "config.json"
    path.write_text(json.dumps(CONFIG))
    return path


def plan(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    # The figures below are worked out for a float16 cache; the default is tested apart.
    dtype = [] if "--dtype" in args else ["--dtype", "float16"]
    code = main(["plan", *args, *dtype])
    out, err = capsys.readouterr()
    return code, out, err


def figure(out: str, label: str) -> str:
    """The figure printed after `label` at the start of a line of the plan."""
    match = re.search(rf"^\s*{re.escape(label)}\s+([\d,.]+x?)", out, re.MULTILINE)
    assert match is not None, f"no line {label!r} in:\n{out}"
    return match.group(1)


def test_parse_bytes_understands_decimal_and_binary_units() -> None:
    assert parse_bytes("4GiB") == 4 * 2**30
    assert parse_bytes("4G") == 4 * 2**30
    assert parse_bytes("1.5GB") == 1_500_000_000
    assert parse_bytes("512 MiB") == 512 * 2**20
    assert parse_bytes("1000") == 1000


@pytest.mark.parametrize("text", ["", "lots", "4 GiBs", "-1GiB", "1e9"])
def test_parse_bytes_rejects_what_it_cannot_read(text: str) -> None:
    with pytest.raises(ValueError, match="cannot parse size"):
        parse_bytes(text)


def test_format_bytes_picks_the_largest_unit() -> None:
    assert format_bytes(4 * 2**30) == "4.00 GiB"
    assert format_bytes(1536) == "1.50 KiB"
    assert format_bytes(12) == "12 B"


def test_capacity_plan_arithmetic() -> None:
    shape = ModelShape(32, 8, 128, torch.float16)
    p = CapacityPlan(
        shape, 2**30, block_size=16, max_model_len=4096, prompt_len=1000, output_len=24
    )
    assert p.bytes_per_token == BYTES_PER_TOKEN
    assert p.bytes_per_block == 16 * BYTES_PER_TOKEN
    assert p.num_blocks == 2**30 // (16 * BYTES_PER_TOKEN) == 512
    assert p.tokens_fit == 8192
    assert p.blocks_per_seq == 64
    assert p.paged_seqs == 8
    assert p.reserved_seqs == 2
    assert p.full_context_seqs == 2  # long contexts are not cheaper when paged
    assert p.paged_vs_reserved == 4.0


def test_plan_on_a_config_json_prints_every_figure(
    capsys: pytest.CaptureFixture[str], config_json: Path
) -> None:
    code, out, _ = plan(
        capsys, "--model", str(config_json), "--budget", "1GiB", "--prompt-len", "1000",
        "--output-len", "24",
    )  # fmt: skip
    assert code == 0
    assert figure(out, "bytes per token") == f"{BYTES_PER_TOKEN:,}"
    assert figure(out, "bytes per block") == f"{16 * BYTES_PER_TOKEN:,}"
    assert figure(out, "blocks") == "512"
    assert figure(out, "tokens that fit") == "8,192"
    assert figure(out, "paged (64 blocks each)") == "8"
    assert figure(out, "reserving max_model_len each") == "2"
    assert figure(out, "paged / reserved") == "4.00x"


def test_plan_says_long_contexts_still_cost_per_token(
    capsys: pytest.CaptureFixture[str], config_json: Path
) -> None:
    _, out, _ = plan(capsys, "--model", str(config_json), "--budget", "1GiB")
    assert "Long contexts still cost tokens x layers x kv_heads x head_dim x 2 x bytes" in out
    assert "one 4096-token sequence holds 512.00 MiB of KV" in out


def test_plan_accepts_a_checkpoint_directory(
    capsys: pytest.CaptureFixture[str], config_json: Path
) -> None:
    code, out, _ = plan(capsys, "--model", str(config_json.parent), "--budget", "1GiB")
    assert code == 0 and "32 layers, 8 KV heads, head_dim 128, float16" in out


def test_plan_dtype_changes_bytes_per_token(
    capsys: pytest.CaptureFixture[str], config_json: Path
) -> None:
    _, out, _ = plan(capsys, "--model", str(config_json), "--dtype", "float32", "--json")
    assert json.loads(out)["bytes_per_token"] == 2 * BYTES_PER_TOKEN


def test_plan_kv_cache_dtype_float16_halves_a_float32_models_bytes_per_token(
    capsys: pytest.CaptureFixture[str], config_json: Path
) -> None:
    args = ("--model", str(config_json), "--dtype", "float32", "--budget", "1GiB", "--json")
    _, wide, _ = plan(capsys, *args)
    _, narrow, _ = plan(capsys, *args, "--kv-cache-dtype", "float16")
    assert json.loads(narrow)["bytes_per_token"] == BYTES_PER_TOKEN
    assert json.loads(narrow)["num_blocks"] == 2 * json.loads(wide)["num_blocks"]


def test_plan_json_matches_the_capacity_plan(
    capsys: pytest.CaptureFixture[str], config_json: Path
) -> None:
    code, out, _ = plan(
        capsys, "--model", str(config_json), "--budget", "1GiB", "--block-size", "32",
        "--max-model-len", "2048", "--prompt-len", "100", "--output-len", "28", "--json",
    )  # fmt: skip
    shape = ModelShape(32, 8, 128, torch.float16)
    expected = CapacityPlan(
        shape, 2**30, block_size=32, max_model_len=2048, prompt_len=100, output_len=28
    )
    assert code == 0 and json.loads(out) == expected.as_dict()


def test_plan_of_the_tiny_model_uses_its_config(capsys: pytest.CaptureFixture[str]) -> None:
    from pagefleet.worker.tiny_model import tiny_model_config

    cfg = tiny_model_config()
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    expected = (
        cfg.num_hidden_layers
        * (cfg.num_key_value_heads or cfg.num_attention_heads)
        * head_dim
        * 2
        * 2
    )
    code, out, _ = plan(capsys, "--json")
    assert code == 0
    result = json.loads(out)
    assert result["bytes_per_token"] == expected
    assert result["max_model_len"] == cfg.max_position_embeddings


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--model", "/no/such/model"], "not found"),
        (["--budget", "1KiB"], "holds no block"),
        (["--block-size", "24"], "power of two"),
        (["--budget", "plenty"], "cannot parse size"),
        (["--dtype", "float13"], "unknown dtype"),
        (["--prompt-len", "4000", "--output-len", "200"], "exceeds max_model_len"),
    ],
)
def test_bad_input_is_one_line_and_exit_code_2(
    capsys: pytest.CaptureFixture[str], config_json: Path, args: list[str], message: str
) -> None:
    model = [] if "--model" in args else ["--model", str(config_json)]
    code, out, err = plan(capsys, *model, *args)
    assert code == 2
    assert out == ""
    assert err.count("\n") == 1 and err.startswith("pagefleet plan: error:") and message in err


def test_a_config_that_is_not_json_is_a_user_error(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    bad = tmp_path / "config.json"
    bad.write_text("{not json")
    code, _, err = plan(capsys, "--model", str(bad))
    assert code == 2 and "cannot read" in err


def test_plan_runs_as_a_real_process(config_json: Path) -> None:
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": f"{root}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "pagefleet",
            "plan",
            "--model",
            str(config_json),
            "--budget",
            "1GiB",
            "--dtype",
            "float16",
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    assert "tokens that fit" in done.stdout and "8,192" in done.stdout


def test_plan_defaults_to_the_engines_dtype(
    capsys: pytest.CaptureFixture[str], config_json: Path
) -> None:
    code = main(["plan", "--model", str(config_json), "--json"])
    out = json.loads(capsys.readouterr().out)
    engine_bytes = ModelShape(32, 8, 128, parse_dtype(EngineConfig().dtype)).bytes_per_token
    assert code == 0 and out["bytes_per_token"] == engine_bytes

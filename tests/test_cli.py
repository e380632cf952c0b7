"""The `pagefleet` command dispatcher and `pagefleet bench`."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

import pytest

from pagefleet.cli import COMMANDS, build_parser, main
from pagefleet.commands.target import parse_target


def test_help_lists_every_subcommand(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    for name in COMMANDS:
        assert name in out


def test_no_subcommand_prints_help_and_exits_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([]) == 2
    assert "COMMAND" in capsys.readouterr().out


def test_bench_lists_the_benchmark_scripts(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench"]) == 0
    names = capsys.readouterr().out.split()
    assert "kv_utilization" in names and "block_pool" in names


def test_bench_unknown_name_is_a_one_line_error(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "no_such_bench"]) == 2
    err = capsys.readouterr().err.strip()
    assert "unknown benchmark 'no_such_bench'" in err and "\n" not in err


def test_bench_runs_a_script_and_passes_its_arguments(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "kv_utilization", "--smoke"]) == 0
    assert "%" in capsys.readouterr().out


def _bench_names() -> list[str]:
    from pagefleet.commands.bench import _benchmarks_dir

    directory = _benchmarks_dir()
    assert directory is not None
    return sorted(p.stem for p in directory.glob("*.py") if not p.stem.startswith("_"))


@pytest.mark.parametrize("name", _bench_names())
def test_bench_imports_and_runs_every_listed_script(name: str, capsys: pytest.CaptureFixture[str]) -> None:
    # --help runs the script's imports (shared helpers included) and its argument parser.
    assert main(["bench", name, "--help"]) == 0
    assert "usage:" in capsys.readouterr().out


def test_version_prints_the_package_version(capsys: pytest.CaptureFixture[str]) -> None:
    from pagefleet import __version__

    with pytest.raises(SystemExit) as exc:
        main(["--version"])
    assert exc.value.code == 0
    assert capsys.readouterr().out.strip() == f"pagefleet {__version__}"


def _subparsers() -> dict[str, argparse.ArgumentParser]:
    parsers = {}
    for name in COMMANDS:
        parser = build_parser([name])
        action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
        parsers[name] = action.choices[name]
    return parsers


@pytest.mark.parametrize("command", list(COMMANDS))
def test_every_option_has_help(command: str) -> None:
    parser = _subparsers()[command]
    missing = [a.dest for a in parser._actions if not a.help]
    assert not missing, f"pagefleet {command}: options without help: {missing}"


@pytest.mark.parametrize("command", list(COMMANDS))
def test_help_shows_every_set_default(command: str) -> None:
    parser = _subparsers()[command]
    text = " ".join(parser.format_help().split())
    for action in parser._actions:
        shown = action.option_strings and action.dest != "help"
        has_default = action.default not in (None, False, [], "", argparse.SUPPRESS)
        if shown and has_default and "default" not in (action.help or ""):
            assert f"(default: {action.default})" in text, f"--{action.dest}"


def test_logs_carry_no_colours_or_progress_bars_when_stderr_is_not_a_terminal(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    for name in ("RAY_COLOR_PREFIX", "TQDM_DISABLE"):
        monkeypatch.delenv(name, raising=False)
    assert main(["bench"]) == 0  # pytest's stderr is not a terminal
    assert os.environ["RAY_COLOR_PREFIX"] == "0" and os.environ["TQDM_DISABLE"] == "1"


@pytest.mark.parametrize(
    ("target", "expected"),
    [
        ("localhost", "localhost:50051"),
        ("10.0.0.5:6000", "10.0.0.5:6000"),
        ("grpc://example.org:7000", "example.org:7000"),
        ("grpc://example.org", "example.org:50051"),
        ("[::1]:9000", "[::1]:9000"),
        ("::1", "[::1]:50051"),
    ],
)
def test_target_accepts_host_host_port_and_grpc_urls(target: str, expected: str) -> None:
    assert parse_target(target) == expected


@pytest.mark.parametrize(
    ("target", "message"),
    [
        ("http://127.0.0.1:8000", "HTTP URL"),
        ("host:notaport", "port must be a number"),
        ("host:70000", "port must be a number"),
        ("ftp://host", "unknown scheme"),
    ],
)
def test_target_refuses_what_is_not_a_grpc_address(target: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse_target(target)


def test_generate_against_an_http_url_is_a_one_line_error(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["generate", "hi", "--target", "http://127.0.0.1:8000"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("pagefleet generate: error:") and "gRPC" in err and "\n" not in err


def test_status_connection_failure_says_what_to_check(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["status", "--target", "127.0.0.1:1", "--timeout", "2"]) == 2
    err = capsys.readouterr().err.strip()
    assert "UNAVAILABLE" in err and "gRPC port" in err and "\n" not in err


def test_status_against_the_http_port_names_the_grpc_port(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["status", "--target", "127.0.0.1:8000", "--timeout", "2"]) == 2
    assert "8000 is the OpenAI HTTP port" in capsys.readouterr().err


def test_generate_on_a_cuda_device_without_cuda_is_a_one_line_error(
    capsys: pytest.CaptureFixture[str],
) -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA: the refusal needs a CPU-only torch")
    assert main(["generate", "hi", "--device", "cuda"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("pagefleet generate: error: device 'cuda'") and "\n" not in err


def test_generate_on_a_checkpoint_without_weights_is_a_one_line_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "config.json").write_text('{"model_type": "llama"}')
    assert main(["generate", "hi", "--model", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert "has no weights" in err and "\n" not in err


def test_plan_refuses_a_max_model_len_beyond_the_models_limit(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "--max-model-len", "100000"]) == 2
    assert "exceeds the built-in tiny model's limit" in capsys.readouterr().err


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the driver paths are Linux's")
@pytest.mark.parametrize("driver", [False, True], ids=["no GPU driver", "a GPU driver"])
def test_serve_counts_gpus_without_importing_torch_where_no_gpu_driver_is_loaded(
    driver: bool, tmp_path: Path
) -> None:
    # A fresh process: this one has torch imported already.
    paths = (str(tmp_path) if driver else str(tmp_path / "absent"),)
    code = (
        "import sys\nfrom pathlib import Path\nfrom pagefleet.commands import preflight\n"
        f"preflight.GPU_DRIVER_PATHS = tuple(Path(p) for p in {paths!r})\n"
        "print(preflight._gpus(), 'torch' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, check=True).stdout.split()  # fmt: skip
    if driver:
        import torch

        assert out == [str(torch.cuda.device_count()), "True"]
    else:
        assert out == ["0", "False"]

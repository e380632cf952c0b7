"""`pagefleet serve` / `status` argument handling that needs no cluster."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from pagefleet.cli import CommandError, main
from pagefleet.commands.serve import load_config


def _args(**kw: object) -> argparse.Namespace:
    base: dict[str, object] = {"config": None, "model": None, "workers": None}
    base.update(kw)
    return argparse.Namespace(**base)


def test_serve_without_arguments_uses_two_workers_on_smollm2() -> None:
    config = load_config(_args())
    assert [(p.engine.model, p.workers) for p in config.pools] == [("smollm2-135m-instruct", 2)]


def test_serve_workers_flag_applies_to_every_pool(tmp_path: Path) -> None:
    path = tmp_path / "cluster.yaml"
    path.write_text("pools:\n  - name: a\n  - name: b\n    workers: 3\n")
    config = load_config(_args(config=str(path), workers=4))
    assert [p.workers for p in config.pools] == [4, 4]


def test_invalid_config_is_a_one_line_user_error_naming_the_field(tmp_path: Path) -> None:
    path = tmp_path / "cluster.yaml"
    path.write_text("pools:\n  - name: a\n    workers: 0\n")
    with pytest.raises(CommandError, match="workers"):
        load_config(_args(config=str(path)))


def test_status_against_nothing_exits_2_with_the_grpc_code(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["status", "--target", "127.0.0.1:1", "--timeout", "2"]) == 2
    assert "UNAVAILABLE" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--model", "/nonexistent/model"], "pools[0] (default): model '/nonexistent/model'"),
        (["--metrics-port", "70000"], "--metrics-port must be in [0, 65535]"),
        (["--grpc-port", "70000"], "--grpc-port must be in [0, 65535]"),
    ],
)
def test_serve_refuses_bad_input_before_ray_starts(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    import ray

    assert main(["serve", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("pagefleet serve: error:") and message in err and "\n" not in err
    assert not ray.is_initialized()


def test_serve_refuses_a_checkpoint_without_weights(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "config.json").write_text('{"model_type": "llama"}')
    assert main(["serve", "--model", str(tmp_path)]) == 2
    assert "has no weights" in capsys.readouterr().err


def test_serve_refuses_a_cuda_pool_without_cuda(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA: the refusal needs a CPU-only torch")
    path = tmp_path / "cluster.yaml"
    path.write_text("pools:\n  - {name: gpu, device: cuda}\n")
    assert main(["serve", "--config", str(path)]) == 2
    assert "pools[0] (gpu): device 'cuda'" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--pool", "default", "--workers", "0"], "--workers must be >= 1 (a pool keeps at least one worker), got 0"),
        (["--workers", "2"], "--workers needs --pool NAME"),
        ([], "give exactly one of --workers N (with --pool) and --remove WORKER_ID"),
        (["--pool", "a", "--workers", "2", "--remove", "a-0"], "give exactly one of"),
        (["--pool", "a", "--remove", "a-0"], "--remove names the worker; --pool goes with --workers"),
        (["--pool", "a", "--workers", "2", "--timeout", "0"], "--timeout must be > 0 seconds, got 0"),
        (["--remove", "a-1", "--drain-timeout", "-1"], "--drain-timeout must be > 0 seconds, got -1"),
    ],
)
def test_scale_bad_input_is_one_line_and_exit_2_before_any_connection(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["scale", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("pagefleet scale: error: ") and "\n" not in err
    assert message in err


def test_scale_help_names_every_flag_with_its_default(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["scale", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    for flag in ("--pool", "--workers", "--remove", "--timeout", "--drain-timeout", "--address"):
        assert flag in out
    assert "(default: 300.0)" in out and "(default: 60.0)" in out and "$RAY_ADDRESS or auto" in out


def test_a_driver_connecting_by_address_sends_the_token_it_has(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from pagefleet.cluster.app import use_cluster_token

    monkeypatch.setenv("HOME", str(tmp_path))
    assert not use_cluster_token({})  # no token anywhere: the mode stays unset
    assert use_cluster_token(env := {"RAY_AUTH_TOKEN": "secret"}) and env["RAY_AUTH_MODE"] == "token"
    assert not use_cluster_token(env := {"RAY_AUTH_MODE": "disabled"}) and env["RAY_AUTH_MODE"] == "disabled"
    (tmp_path / ".ray").mkdir()
    (tmp_path / ".ray" / "auth_token").write_text("secret")
    assert use_cluster_token(env := {}) and env["RAY_AUTH_MODE"] == "token"

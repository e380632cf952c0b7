"""The `pagefleet` command dispatcher and `pagefleet bench`."""

from __future__ import annotations

import pytest

from pagefleet.cli import COMMANDS, main


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

"""Driving `dg` in-process for the CLI tests (Typer's CliRunner), and the shape every bad input must have."""

from __future__ import annotations

from typer.testing import CliRunner

from dgcli import cli

runner = CliRunner()


def run(*args, input=None):
    return runner.invoke(cli.app, [str(a) for a in args], input=input)


def assert_one_line_error(result, *fragments):
    assert result.exit_code != 0, result.stdout
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    assert "Traceback" not in result.stderr + result.stdout
    for f in fragments:
        assert f in lines[0], lines[0]

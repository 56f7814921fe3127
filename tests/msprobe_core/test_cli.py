"""The command line: ``-f/--framework`` before the command (msprobe's way) or after it."""

from __future__ import annotations

import pytest

from msprobe_core.cli import build_parser, main


def _framework(monkeypatch, argv: list[str]) -> str:
    """The framework ``config_check`` runs with for ``argv`` (its run() replaced by a spy)."""
    from msprobe_core.config_check import cli as cc_cli

    seen = []
    monkeypatch.setattr(cc_cli, "run", lambda args: seen.append(args.framework) or 0)
    assert main(argv) == 0
    return seen[0]


@pytest.mark.parametrize("argv,expected", [
    (["-f", "mindspore", "config_check", "-d", "run.sh"], "mindspore"),        # msprobe's documented order
    (["--framework", "mindspore", "config_check", "-d", "run.sh"], "mindspore"),
    (["--framework=mindspore", "config_check", "-d", "run.sh"], "mindspore"),
    (["config_check", "-f", "mindspore", "-d", "run.sh"], "mindspore"),       # after the command
    (["-f", "mindspore", "config_check", "-f", "mindspore", "-d", "run.sh"], "mindspore"),
    (["-f", "pytorch", "config_check", "-d", "run.sh"], "pytorch"),
    (["config_check", "-d", "run.sh"], "pytorch"),                            # the default
])
def test_framework_before_or_after_the_command(monkeypatch, argv, expected):
    assert _framework(monkeypatch, argv) == expected


def test_framework_on_both_sides_must_agree(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["-f", "mindspore", "config_check", "-f", "pytorch", "-d", "run.sh"])
    assert exc.value.code == 2
    assert "-f mindspore before config_check and -f pytorch after it disagree" in capsys.readouterr().err


def test_framework_before_a_command_without_the_option_is_accepted_and_checked(tmp_path, capsys):
    assert main(["-f", "pytorch", "recover", str(tmp_path)]) == main(["recover", str(tmp_path)])
    assert "-f {pytorch,mindspore}, --framework {pytorch,mindspore}" in build_parser().format_help()
    with pytest.raises(SystemExit):
        main(["-f", "tensorflow", "recover", str(tmp_path)])
    assert "invalid choice: 'tensorflow'" in capsys.readouterr().err

"""app.cli: which commands exist and in which order, how the requested command is found, what a parsed command
carries, and a command found in app/commands without a line in COMMANDS."""
from __future__ import annotations

import sys

import pytest

import app.arguments
import app.commands

from app import cli


def test_the_listed_commands_come_first_in_their_order():
    available = cli.available_commands()
    assert available[: len(cli.COMMANDS)] == list(cli.COMMANDS)
    assert "remote_runs" not in available  # a helper module of app/commands without arguments is no command


@pytest.mark.parametrize(("argv", "expected"), [
    (["run", "c.yaml"], "run"),
    (["--version"], None),
    (["--help"], None),
    (["c.yaml"], None),  # not a command name
    ([], None),
])
def test_requested_command_is_the_first_word(argv, expected):
    assert cli.requested_command(argv) == expected


def test_a_parsed_command_carries_its_arguments_and_debug():
    args = cli.build_parser(load=["run"]).parse_args(["run", "c.yaml", "--set", "a=1", "--set", "b=2", "--debug"])
    assert (args.command, args.config, args.overrides, args.executor, args.debug) == ("run", "c.yaml",
                                                                                     ["a=1", "b=2"], "local", True)


def test_without_a_command_main_prints_the_help_and_exits_2(capsys):
    assert cli.main([]) == 2
    assert capsys.readouterr().out.startswith("usage: compat")


def test_an_unknown_executor_is_refused_by_argparse(capsys):
    with pytest.raises(SystemExit) as end:
        cli.main(["run", "c.yaml", "--executor", "dask"])
    assert end.value.code == 2 and "invalid choice: 'dask' (choose from 'local', 'ray')" in capsys.readouterr().err


def test_a_command_not_in_commands_is_found_with_its_help_line(monkeypatch, tmp_path, capsys):
    # a command whose two modules exist, in folders added to the app.commands / app.arguments packages
    commands, arguments = tmp_path / "commands", tmp_path / "arguments"
    commands.mkdir()
    arguments.mkdir()
    (commands / "hello.py").write_text("def run(args):\n    print('hello', args.who)\n    return 0\n")
    (arguments / "hello.py").write_text("HELP = 'say hello'\n\ndef add_arguments(parser):\n"
                                        "    parser.add_argument('who')\n")
    monkeypatch.setattr(app.commands, "__path__", [*app.commands.__path__, str(commands)])
    monkeypatch.setattr(app.arguments, "__path__", [*app.arguments.__path__, str(arguments)])
    available = cli.available_commands()
    assert "hello" in available and available.index("hello") >= len(cli.COMMANDS)  # after the listed ones
    assert cli.command_help("hello") == "say hello"
    assert cli.main(["hello", "world"]) == 0
    assert capsys.readouterr().out == "hello world\n"
    for name in ("app.commands.hello", "app.arguments.hello"):
        sys.modules.pop(name, None)

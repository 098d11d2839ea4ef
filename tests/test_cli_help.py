"""Every command's ``--help`` fits one screen (40 lines of 100 columns) and ends with an example
that parses; ``--help`` names every option and ``--help-all`` describes each."""

from __future__ import annotations

import shlex

import click
import pytest
from click.testing import CliRunner

from fp8ptq.cli.help_format import SCREEN_COLUMNS, SCREEN_LINES, full_help
from fp8ptq.cli.main import main

COMMANDS = main.list_commands(None)


def _help(*args: str) -> str:
    result = CliRunner().invoke(main, list(args), terminal_width=SCREEN_COLUMNS)
    assert result.exit_code == 0, result.output
    return result.output


def _example(text: str) -> list[str]:
    """The example's arguments: the lines under ``Example:``, continuation lines joined."""
    lines = text.splitlines()
    body = " ".join(line.strip() for line in lines[lines.index("  Example:") + 1:])
    return [shlex.split(cmd) for cmd in body.replace("\\ ", "").split(" fp8ptq ") if cmd]


def _command(name: str) -> click.Command:
    return main.get_command(click.Context(main), name)


def test_every_command_is_listed():
    assert {"quantize", "eval", "sensitivity", "validate", "formats", "schemes"} <= set(COMMANDS)


@pytest.mark.parametrize("name", ["", *COMMANDS])
def test_help_fits_one_screen_and_shows_an_example(name):
    text = _help(*([name] if name else []), "--help")
    lines = text.splitlines()
    assert len(lines) <= SCREEN_LINES, f"fp8ptq {name} --help: {len(lines)} lines"
    assert max(map(len, lines)) <= SCREEN_COLUMNS
    examples = _example(text)
    assert examples and examples[0][0] == "fp8ptq"
    for args in examples:  # each example is a command line the CLI accepts
        args = [a for a in args if a != "fp8ptq"]
        command = _command(args[0])
        assert command is not None, args
        command.make_context(args[0], args[1:], parent=click.Context(main))
        if name:
            assert args[0] == name


def _has_help_all(name: str) -> bool:
    return any("--help-all" in p.opts for p in _command(name).params)


@pytest.mark.parametrize("name", COMMANDS)
def test_help_names_every_option_and_help_all_describes_each(name):
    brief = _help(name, "--help").split()
    full = " ".join(_help(name, "--help-all").split()) if _has_help_all(name) else None
    for option in (p for p in _command(name).params if isinstance(p, click.Option)):
        flag = next(o for o in option.opts if o.startswith("--"))
        assert flag in brief, flag
        if full is not None and option.help:
            assert " ".join(option.help.split()[:3]) in full, flag


def test_the_big_commands_describe_the_rest_with_help_all():
    for name in ("quantize", "eval", "sensitivity"):
        assert _has_help_all(name)
        full = _help(name, "--help-all")
        assert len(full.splitlines()) > 2 * SCREEN_LINES
        ctx = click.Context(_command(name), info_name=name, terminal_width=SCREEN_COLUMNS,
                            max_content_width=SCREEN_COLUMNS)
        # the reference a generated page reads (all but the usage line's program name)
        assert full_help(ctx).splitlines()[1:] == full.splitlines()[1:]
        assert ctx.get_help() != full_help(ctx)  # and --help stays the short one

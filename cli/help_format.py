"""One-screen ``--help``: a command's usage, what it does, its common options, an example.

``quantize``, ``eval`` and ``sensitivity`` take some sixty flags each (the recipe's, the loading
ones, their own); listed with their help they fill four screens, and a reader looking for how to
start scrolls past them all. ``--help`` therefore describes the options a first run uses, names
every other one, and ends with a command to copy; ``--help-all`` prints every option with its
help, the flag reference.
"""

from __future__ import annotations

import textwrap

import click

SCREEN_LINES = 40
SCREEN_COLUMNS = 100
EXAMPLE_MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"  # the model the examples quantize
_FULL = "fp8ptq.help_all"  # ctx.meta key: render every option's help


def example(*lines: str) -> str:
    """A command's epilog: ``Example:`` and the command lines, kept verbatim by click (``\\b``)."""
    return "\b\nExample:\n" + "\n".join(f"  {line}" for line in lines)


def _long_name(param: click.Parameter) -> str:
    return next((opt for opt in param.opts if opt.startswith("--")), param.opts[0])


def _write_names(formatter: click.HelpFormatter, names: list[str]) -> None:
    """Flag names wrapped to the formatter's width, never split at their hyphens."""
    width = max(formatter.width - formatter.current_indent, 20)
    for line in textwrap.wrap(" ".join(names), width, break_on_hyphens=False,
                              break_long_words=False):
        formatter.write(f"{'':>{formatter.current_indent}}{line}\n")


def full_help(ctx: click.Context) -> str:
    """The help of ``ctx``'s command with every option described (what ``--help-all`` prints;
    a generated CLI reference reads this one)."""
    ctx.meta[_FULL] = True
    try:
        return ctx.get_help()
    finally:
        del ctx.meta[_FULL]


def _show_full_help(ctx: click.Context, _param, value: bool) -> None:
    if not value or ctx.resilient_parsing:
        return
    click.echo(full_help(ctx), color=ctx.color)
    ctx.exit()


class OneScreenCommand(click.Command):
    """A click command whose ``--help`` fits :data:`SCREEN_LINES` lines of
    :data:`SCREEN_COLUMNS` columns: the options named in ``common`` with their help, the others
    by name only, and ``--help-all`` shows every option's help (without ``common``: every option
    is described). Pass the example as ``epilog`` (:func:`example`)."""

    def __init__(self, *args, common: tuple[str, ...] | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        self.common = None if common is None else frozenset(common) | {"help_all"}
        if self.common is not None:
            self.params.append(click.Option(
                ["--help-all"], is_flag=True, expose_value=False, is_eager=True,
                callback=_show_full_help, help="Show every option with its help and exit."))

    def format_options(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        if ctx.meta.get(_FULL) or self.common is None:
            return super().format_options(ctx, formatter)
        options = [p for p in self.get_params(ctx)
                   if isinstance(p, click.Option) and p.get_help_record(ctx) is not None]
        common = [p for p in options
                  if p.name in self.common or set(p.opts) & set(ctx.help_option_names)]
        others = [_long_name(p) for p in options if p not in common]
        with formatter.section("Options"):
            formatter.write_dl([p.get_help_record(ctx) for p in common])
        if others:
            title = f"More options (--help-all describes each of these {len(others)})"
            with formatter.section(title):
                _write_names(formatter, others)

"""The ``fp8ptq`` command: a click group whose commands live in sibling modules."""

from __future__ import annotations

import sys

import click

from fp8ptq import __version__, distributed
from fp8ptq.errors import Fp8ptqError


class Fp8ptqGroup(click.Group):
    """Turns an ``Fp8ptqError`` or a click usage error anywhere below into one ``error:`` line
    and its exit code (2 for usage errors)."""

    def invoke(self, ctx):
        try:
            return super().invoke(ctx)
        except Fp8ptqError as e:
            if distributed.is_main():  # under torchrun: one line, from rank 0
                click.echo(f"error: {e}", err=True)
            sys.exit(e.exit_code)
        except click.UsageError as e:
            command = f"{e.ctx.command_path}: " if e.ctx is not None else ""
            click.echo(f"error: {command}{e.format_message()} (see --help)", err=True)
            sys.exit(e.exit_code)


@click.group(cls=Fp8ptqGroup)
@click.version_option(__version__, prog_name="fp8ptq")
def main():
    """FP8 post-training quantization of PyTorch / Hugging Face models."""


def _register():
    from . import formats_cmd

    main.add_command(formats_cmd.formats)
    for module in ("quantize_cmd", "eval_cmd", "sensitivity_cmd"):
        try:
            mod = __import__(f"{__package__}.{module}", fromlist=["command"])
        except ModuleNotFoundError as e:
            if e.name != f"{__package__}.{module}":
                raise
            continue
        main.add_command(mod.command)


_register()

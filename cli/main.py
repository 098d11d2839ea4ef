"""The ``fp8ptq`` command: a click group whose commands live in sibling modules.

Every failure ends in ONE line on stderr, ``error: ...``, and an exit code: 2 bad input, 1 a
runtime failure, 3 a failed ``--max-delta`` gate, 130 / 143 interrupted by SIGINT / SIGTERM.
``--debug`` (or ``FP8PTQ_DEBUG=1``) shows the full traceback instead, for bug reports.
Libraries' own chatter (transformers' loading bars and notes, lm-eval's, tqdm) stays off the
terminal unless ``--verbose``; fp8ptq's own progress bars show the long phases.
"""

from __future__ import annotations

import importlib
import logging
import os
import signal
import sys
import warnings

import click

from fp8ptq import __version__
from fp8ptq.errors import Fp8ptqError, first_line
from fp8ptq.observe import distributed
from fp8ptq.runtime.usage import bound_heap

from .help_format import EXAMPLE_MODEL, SCREEN_COLUMNS, example

# name -> (module of this package, attribute). A command's module is imported when that command
# runs (click's documented "lazily loading subcommands" pattern), not all five at start-up:
# ``eval`` pulls lm-eval, datasets, pandas and pyarrow, resident memory that
# ``quantize`` never uses and would otherwise carry into its peak RSS.
COMMANDS = {
    "formats": ("formats_cmd", "formats"),
    "schemes": ("formats_cmd", "schemes"),
    "quantize": ("quantize_cmd", "command"),
    "eval": ("eval_cmd", "command"),
    "sensitivity": ("sensitivity_cmd", "command"),
    "validate": ("validate_cmd", "command"),
}


class Interrupted(BaseException):
    """SIGINT / SIGTERM: unwinds like KeyboardInterrupt, so every ``finally`` and
    ``except BaseException`` cleanup (the temporary output folder) runs."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.exit_code = 128 + signum


def _raise_interrupted(signum, _frame):
    raise Interrupted(signum)


def debug_enabled() -> bool:
    return os.environ.get("FP8PTQ_DEBUG", "").lower() not in ("", "0", "false", "no")


def quiet_libraries() -> None:
    """Keep transformers', huggingface_hub's, lm-eval's and tqdm's own output off stderr."""
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("TQDM_DISABLE", "1")
    for name in ("transformers", "huggingface_hub", "lm-eval", "lm_eval", "accelerate",
                 "datasets", "torch.distributed"):
        logging.getLogger(name).setLevel(logging.ERROR)
    try:
        from transformers.utils import logging as hf_logging

        hf_logging.set_verbosity_error()
        hf_logging.disable_progress_bar()
    except ImportError:  # pragma: no cover - transformers is a dependency
        pass
    warnings.filterwarnings("ignore", module="transformers")
    warnings.filterwarnings("ignore", module="accelerate")
    _silence_tqdm()


def _silence_tqdm() -> None:
    """tqdm reads TQDM_DISABLE when it is imported, usually before us: turn off every bar
    (lm-eval's request bars, transformers' shard bars) at construction instead."""
    try:
        import tqdm.std
    except ImportError:  # pragma: no cover - a dependency of transformers
        return
    if getattr(tqdm.std.tqdm.__init__, "_fp8ptq_quiet", False):
        return
    original = tqdm.std.tqdm.__init__

    def __init__(self, *args, **kwargs):
        kwargs["disable"] = True
        original(self, *args, **kwargs)

    __init__._fp8ptq_quiet = True
    tqdm.std.tqdm.__init__ = __init__


class Fp8ptqGroup(click.Group):
    """Turns an ``Fp8ptqError``, a click usage error, an interruption or an unexpected exception
    anywhere below into one ``error:`` line and its exit code. Commands load lazily
    (``COMMANDS``)."""

    def list_commands(self, ctx):
        return sorted({*super().list_commands(ctx), *COMMANDS})

    def get_command(self, ctx, name):
        if name in COMMANDS and name not in self.commands:
            module, attr = COMMANDS[name]
            self.add_command(getattr(importlib.import_module(f"{__package__}.{module}"), attr),
                             name)
        return super().get_command(ctx, name)

    def invoke(self, ctx):
        debug = debug_enabled() or bool(ctx.params.get("debug"))
        previous = {s: signal.signal(s, _raise_interrupted)
                    for s in (signal.SIGINT, signal.SIGTERM)}
        try:
            return super().invoke(ctx)
        except Fp8ptqError as e:
            if debug:
                raise
            _fail(str(e), e.exit_code)
        except click.UsageError as e:
            command = f"{e.ctx.command_path}: " if e.ctx is not None else ""
            _fail(f"{command}{e.format_message()} (see --help)", e.exit_code)
        except (Interrupted, KeyboardInterrupt) as e:
            code = getattr(e, "exit_code", 130)
            name = "SIGTERM" if code == 143 else "SIGINT"
            _fail(f"interrupted ({name}); nothing was written", code)
        except click.exceptions.Exit:
            raise
        except OSError as e:
            if debug:
                raise
            _fail(_os_error_line(e), 1)
        except Exception as e:  # noqa: BLE001 - a bug: one line, the traceback with --debug
            if debug:
                raise
            if type(e).__name__ == "OutOfMemoryError":  # torch's (not imported here: --help)
                _fail(out_of_memory_line(e), 1)
            _fail(f"internal error: {type(e).__name__}: {first_line(e)} (run with --debug "
                  "for the traceback and please report it)", 1)
        finally:
            for s, handler in previous.items():
                signal.signal(s, handler)


def out_of_memory_line(e: Exception) -> str:
    """A CUDA out-of-memory error as one line: what ran out and how to give the run a GPU
    budget it can keep (quantize then works one block at a time on the GPU)."""
    return (f"the GPU ran out of memory ({first_line(e)[:160]}); give the run a GPU budget "
            "below what is free, e.g. --max-memory 0=20GiB (quantize then works one block at "
            "a time on the GPU), or a smaller --batch-size")


def _os_error_line(e: OSError) -> str:
    where = f" ({e.filename})" if getattr(e, "filename", None) else ""
    return f"{e.strerror or first_line(e)}{where}"



def _fail(message: str, code: int):
    if distributed.is_main():  # under torchrun: one line, from rank 0
        click.echo(f"error: {message}", err=True)
    sys.exit(code)


@click.group(cls=Fp8ptqGroup, context_settings={"max_content_width": SCREEN_COLUMNS},
             epilog=example(f"fp8ptq quantize {EXAMPLE_MODEL} --calib-data calib.txt -o out/e4m3",
                            "fp8ptq eval out/e4m3 --tasks wikitext",
                            "fp8ptq validate out/e4m3 --runtime vllm"))
@click.version_option(__version__, prog_name="fp8ptq")
@click.option("--verbose", is_flag=True, help="Let the libraries' own logs and bars through.")
@click.option("--debug", is_flag=True,
              help="Show full tracebacks instead of one error line (also FP8PTQ_DEBUG=1).")
def main(verbose, debug):
    """FP8 post-training quantization of PyTorch / Hugging Face models."""
    bound_heap()  # large tensors mapped and unmapped: see fp8ptq.runtime.usage.bound_heap
    if not verbose:
        quiet_libraries()

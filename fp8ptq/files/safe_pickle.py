"""Reading ``torch.save`` files without running code from them.

A pickle can name any importable callable, and full unpickling calls it: a ``.pt`` file from the
internet can run a shell command the moment it is loaded. So fp8ptq reads every ``.pt`` file
with ``torch.load(weights_only=True)``, whose unpickler only builds tensors, containers and the
classes explicitly allowed. A whole pickled ``nn.Module`` is allowed when every class it names
is a torch.nn layer or one of fp8ptq's built-in architectures (``fp8ptq.vision``): building
those runs no code of the file's choosing. Anything else needs ``trust_pickle=True``
(``--trust-pickle``): then, and only then, the file is unpickled in full.
"""

from __future__ import annotations

import importlib
import pickle
import zipfile
from pathlib import Path

import torch

from ..errors import DataError, first_line

SAFE_PREFIXES = ("torch.nn.modules.", "fp8ptq.vision.")
SAFE_NAMES = {"collections.OrderedDict", "torch.nn.parameter.Parameter",
              "torch._utils._rebuild_parameter", "builtins.set"}


def _is_safe(name: str) -> bool:
    return name in SAFE_NAMES or name.startswith(SAFE_PREFIXES)


def _resolve(name: str):
    module, _, attr = name.rpartition(".")
    return getattr(importlib.import_module(module), attr)


def load_torch_file(path: str | Path, *, trust_pickle: bool = False, what: str = "file"):
    """``torch.load`` of ``path`` on the CPU that runs no code from the file unless
    ``trust_pickle``. Raises ``DataError`` (one line, naming ``--trust-pickle``) otherwise."""
    path = Path(path)
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as first:
        refused = first
    except Exception as e:  # not a torch file at all, truncated zip, ...
        raise DataError(f"cannot load {what} {path}: {first_line(e)}") from None
    if not zipfile.is_zipfile(path):  # not torch's zip format: garbage or a legacy pickle
        if not trust_pickle:
            raise DataError(f"cannot load {what} {path}: not a torch.save zip file "
                            f"({first_line(refused)}); a legacy pickle loads only with "
                            "--trust-pickle")
        names = None
    else:
        try:
            names = torch.serialization.get_unsafe_globals_in_checkpoint(path)
        except Exception:  # noqa: BLE001 - unreadable records: decided by trust below
            names = None
    if names is not None and names and all(_is_safe(n) for n in names):
        try:
            with torch.serialization.safe_globals([_resolve(n) for n in names]):
                return torch.load(path, map_location="cpu", weights_only=True)
        except Exception as e:  # noqa: BLE001 - fall through to the trust decision
            refused = e
    if not trust_pickle:
        listed = ", ".join(sorted(n for n in names or [] if not _is_safe(n))[:3])
        detail = f" (it names {listed})" if listed else f" ({first_line(refused)})"
        raise DataError(f"refusing to unpickle {what} {path}: loading it would run code named in "
                        f"the file{detail}; pass --trust-pickle (trust_pickle=True) only if "
                        "you trust its source")
    try:
        return torch.load(path, map_location="cpu", weights_only=False)
    except Exception as e:  # unpickling raises anything, e.g. a class that no longer exists
        raise DataError(f"cannot load {what} {path}: {first_line(e)}") from None


"""Reading the small JSON files that come with models and checkpoints (config.json,
fp8ptq.json, tokenizer files, shard indexes) with one line per problem.

The library error (``json.JSONDecodeError``, ``UnicodeDecodeError``) is mapped here, where the
file is opened, into a ``DataError`` that names the file and the place: ``PATH:LINE:COLUMN:
message``, the form editors and CI logs link to.
"""

from __future__ import annotations

import json
from pathlib import Path

from ..errors import DataError


def read_json(path, *, expect: type | None = dict):
    """The parsed contents of JSON file ``path``; ``DataError`` (one line, naming the file)
    when it is missing, not UTF-8, not JSON or (``expect``) not of the expected type."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise DataError(f"{path} is missing") from None
    except IsADirectoryError:
        raise DataError(f"{path} is a folder, not a JSON file") from None
    except UnicodeDecodeError as e:
        raise DataError(f"{path}: not UTF-8 text (byte 0x{e.object[e.start]:02x} at offset "
                        f"{e.start})") from None
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise DataError(f"{path}:{e.lineno}:{e.colno}: {e.msg}") from None
    if expect is not None and not isinstance(value, expect):
        kind = "a JSON object" if expect is dict else f"a JSON {expect.__name__}"
        raise DataError(f"{path} is not {kind}")
    return value

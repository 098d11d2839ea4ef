"""A model's weights read from its safetensors files tensor by tensor: fp8ptq's one weight reader.

Every path that reads a local safetensors checkpoint reads it through ``SafetensorsSource``:
the in-memory pipeline's loader and sequential quantization (``fp8ptq.io.weights``: the whole
model, or one block's tensors at a time, into a model built without weights) and the
model-free path (``fp8ptq.execution.model_free``: one GEMM weight at a time, never a model). Every
shard's header is parsed and checked when the source opens (before anything is written): a
truncated or corrupt shard, or an index naming a tensor its shard lacks, is one ``DataError``
line naming the file. Tensors are then read with positioned reads (``os.preadv``, which
releases the GIL) straight into a tensor of their own: memory is the tensor read, not the
shard, and no page of the file stays mapped into the process (a memory-mapped shard would
count in its RSS up to the shard's size).

Which checkpoint tensor makes which parameter is ``fp8ptq.io.weight_map``'s job (transformers'
own rules); where MODEL's safetensors folder is, ``fp8ptq.io.loading.resolve_safetensors``.
"""

from __future__ import annotations

import json
import os
import struct
import threading
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from ..errors import DataError, first_line
from .files import read_json

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
# safetensors dtype names (https://github.com/huggingface/safetensors, format.md)
DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16,
          "BF16": torch.bfloat16, "I64": torch.int64, "I32": torch.int32, "I16": torch.int16,
          "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool,
          "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2}
MAX_HEADER = 100 * 1024 * 1024  # the format's own limit on the JSON header


@dataclass(frozen=True)
class TensorEntry:
    """Where one tensor's bytes are: ``file`` from byte ``start`` to ``end`` (absolute)."""

    name: str
    file: Path
    dtype: torch.dtype
    shape: tuple[int, ...]
    start: int
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.start


def read_header(path: Path) -> dict[str, TensorEntry]:
    """The tensors of one safetensors file, checked against the file's size. safetensors'
    own ``safe_open`` validates the header first (its message is the one users see)."""
    try:
        with safe_open(path, "pt"):
            pass
    except SafetensorError as e:
        raise DataError(f"{path}: corrupt or truncated safetensors file ({first_line(e)})") \
            from None
    except OSError as e:
        raise DataError(f"{path}: cannot read ({first_line(e)})") from None
    size = path.stat().st_size
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        if n > min(MAX_HEADER, size - 8):
            raise DataError(f"{path}: corrupt safetensors header")
        header = json.loads(f.read(n))
    base = 8 + n
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        start, end = info["data_offsets"]
        if info["dtype"] not in DTYPES:
            raise DataError(f"{path}: tensor {name} has dtype {info['dtype']}, which fp8ptq does "
                            "not read")
        if base + end > size:
            raise DataError(f"{path}: truncated (tensor {name} ends past the end of the file)")
        out[name] = TensorEntry(name, path, DTYPES[info["dtype"]], tuple(info["shape"]),
                                base + start, base + end)
    return out


class SafetensorsSource:
    """The tensors of a (sharded) safetensors checkpoint folder, by name, in file order."""

    def __init__(self, folder: str | Path):
        self.folder = Path(folder)
        index = self.folder / INDEX_NAME
        single = self.folder / SINGLE_NAME
        if index.is_file():
            weight_map = read_json(index).get("weight_map")
            if not isinstance(weight_map, dict):
                raise DataError(f"{index}: not a safetensors index (no weight_map)")
            files = sorted({self.folder / v for v in weight_map.values()})
            for f in files:
                if not f.is_file():
                    raise DataError(f"{index} names {f.name}, which is missing")
        elif single.is_file():
            weight_map, files = None, [single]
        else:
            raise DataError(f"{folder}: no {SINGLE_NAME} or {INDEX_NAME} (a safetensors "
                            "checkpoint folder is needed here)")
        headers = {f: read_header(f) for f in files}
        self.entries: dict[str, TensorEntry] = {}
        if weight_map is None:
            self.entries = dict(headers[single])
        else:
            for name, fname in weight_map.items():
                entry = headers[self.folder / fname].get(name)
                if entry is None:
                    raise DataError(f"{self.folder / fname}: tensor {name} (listed in {INDEX_NAME})"
                                    " is missing from it")
                self.entries[name] = entry
        # file order, then offset order: reading in this order is one sequential pass per file
        self.entries = dict(sorted(self.entries.items(),
                                   key=lambda kv: (str(kv[1].file), kv[1].start)))
        self.files = {n: e.file for n, e in self.entries.items()}
        self._fds: dict[Path, int] = {}
        self._lock = threading.Lock()

    def names(self) -> list[str]:
        return list(self.entries)

    def __contains__(self, name: str) -> bool:
        return name in self.entries

    @property
    def total_bytes(self) -> int:
        return sum(e.nbytes for e in self.entries.values())

    def read(self, names) -> dict[str, torch.Tensor]:
        return {n: self.read_one(n) for n in names}

    def read_one(self, name: str) -> torch.Tensor:
        """A fresh tensor holding ``name`` (its own memory; nothing of the file stays mapped)."""
        e = self.entries[name]
        buf = torch.empty(e.nbytes, dtype=torch.uint8)
        view = memoryview(buf.numpy())
        fd, done = self._fd(e.file), 0
        while done < e.nbytes:  # preadv may return less than asked (e.g. above 2 GiB)
            n = os.preadv(fd, [view[done:]], e.start + done)
            if n <= 0:
                raise DataError(f"{e.file}: truncated while reading tensor {name}")
            done += n
        return buf.view(e.dtype).reshape(e.shape) if e.nbytes else torch.empty(e.shape,
                                                                                dtype=e.dtype)

    def _fd(self, path: Path) -> int:
        with self._lock:
            if path not in self._fds:
                self._fds[path] = os.open(path, os.O_RDONLY)
            return self._fds[path]

    def close(self) -> None:
        with self._lock:
            for fd in self._fds.values():
                os.close(fd)
            self._fds.clear()

    def __del__(self):
        try:
            self.close()
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass


def is_safetensors_folder(path: Path) -> bool:
    return (path / "config.json").is_file() and ((path / SINGLE_NAME).is_file()
                                                 or (path / INDEX_NAME).is_file())


__all__ = ["SafetensorsSource", "TensorEntry", "read_header", "is_safetensors_folder", "DTYPES",
           "INDEX_NAME", "SINGLE_NAME"]

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
from ..files.json_files import read_json

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


# compressed-tensors formats whose weights are 8-bit float codes with a float32 scale beside them
CT_FLOAT_FORMATS = ("float-quantized", "naive-quantized")
FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
# tensors that describe a quantized checkpoint's numbers rather than a model parameter
CT_SCALE_SUFFIXES = (".weight_scale", ".input_scale", ".weight_zero_point", ".input_zero_point",
                     ".k_scale", ".v_scale", ".q_scale")


@dataclass(frozen=True)
class Prequantized:
    """A checkpoint another tool wrote in FP8 (compressed-tensors' float-quantized format, as
    llm-compressor writes FP8 / FP8_DYNAMIC / FP8_BLOCK): its ``weight`` codes times its
    ``weight_scale`` (one per tensor, per output channel, or per ``block`` tile) are the
    weights it stands for, which fp8ptq then quantizes like any float model's."""

    strategies: tuple[str, ...]
    block: tuple[int, int] | None

    def describe(self) -> str:
        block = f" {self.block[0]}x{self.block[1]}" if self.block else ""
        return f"compressed-tensors FP8 ({'/'.join(self.strategies)}{block} weight scales)"

    def dequantize(self, codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        """float32 weights: ``codes * scale``, a 2-D ``[rows/B, cols/B]`` scale spread over its
        tiles (the last ones cut at the weight's edge)."""
        w, scale = codes.float(), scale.float()
        if scale.numel() == 1:
            return w * scale.reshape(())
        if scale.dim() == 2 and scale.shape[1] > 1:  # [rows/B, cols/B] tiles
            bh, bw = self.block or (-(-w.shape[0] // scale.shape[0]),
                                    -(-w.shape[1] // scale.shape[1]))
            scale = scale.repeat_interleave(bh, 0)[:w.shape[0]]
            return w * scale.repeat_interleave(bw, 1)[:, :w.shape[1]]
        return w * scale.reshape(-1, *([1] * (w.dim() - 1)))  # one per output channel


def prequantized(folder: str | Path) -> Prequantized | None:
    """What ``folder``'s config.json says about weights already quantized by another tool:
    ``None`` for a float checkpoint (or another method, left to ``from_pretrained``), a
    ``Prequantized`` for compressed-tensors FP8 weights, a ``DataError`` for compressed-tensors
    weights fp8ptq cannot undo (4-bit packs, integer codes, MXFP8)."""
    path = Path(folder) / "config.json"
    qc = read_json(path).get("quantization_config") if path.is_file() else None
    if not qc:
        return None
    method = qc.get("quant_method")
    if method != "compressed-tensors":
        return None  # another tool's own loader (from_pretrained) decides, as before
    groups = list((qc.get("config_groups") or {}).values())
    weights = [g.get("weights") or {} for g in groups]
    formats = {g.get("format") or qc.get("format") for g in groups}
    if not formats <= set(CT_FLOAT_FORMATS) or not all(
            w.get("type") == "float" and w.get("num_bits") == 8 and not w.get("dynamic")
            and w.get("strategy") in ("tensor", "channel", "block") for w in weights):
        raise DataError(f"{path}: compressed-tensors weights in format "
                        f"{', '.join(sorted(map(str, formats)))}; fp8ptq dequantizes only "
                        "compressed-tensors FP8 weights (float-quantized: tensor, channel or "
                        "block scales)")
    blocks = {tuple(w["block_structure"]) for w in weights if w.get("block_structure")}
    return Prequantized(tuple(sorted({w["strategy"] for w in weights})),
                        blocks.pop() if len(blocks) == 1 else None)


class SafetensorsSource:
    """The tensors of a (sharded) safetensors checkpoint folder, by name, in file order. A
    compressed-tensors FP8 checkpoint (``prequantized``) reads as the float model it stands
    for: each FP8 ``weight`` dequantized with its ``weight_scale``, the scale tensors hidden
    from ``names``, so every path (in-memory, sequential, model-free) sees float weights."""

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
        self._raw = self.entries  # scales included
        self.prequantized = prequantized(self.folder)
        self._scales = {} if self.prequantized is None else {
            n: f"{n}_scale" for n, e in self._raw.items()
            if e.dtype in FP8_DTYPES and n.endswith(".weight") and f"{n}_scale" in self._raw}
        if self.prequantized is not None:
            self.entries = {n: e for n, e in self._raw.items()
                            if not n.endswith(CT_SCALE_SUFFIXES)}

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
        """A fresh tensor holding ``name`` (its own memory; nothing of the file stays mapped);
        a prequantized weight dequantized (float32)."""
        if name in self._scales:
            return self.prequantized.dequantize(self._read(name), self._read(self._scales[name]))
        return self._read(name)

    def _read(self, name: str) -> torch.Tensor:
        e = self._raw[name]
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


# a GGUF's bytes to the bf16 weights they hold, at most (4.5-bit quants: ~3.6x; 8-bit: ~1.9x)
GGUF_EXPANSION = 4


def weights_on_disk(spec: str) -> int | None:
    """About the bytes MODEL ``spec``'s weights take loaded in bf16, from file sizes alone (no
    parsing): a safetensors folder's ``*.safetensors`` (float32 files count double, which errs
    high), a ``.gguf`` file's size times ``GGUF_EXPANSION``, a ``.pt`` file's size; None for a
    hub id or anything else (the caller then assumes nothing)."""
    path = Path(spec).expanduser()
    if path.is_file():
        factor = GGUF_EXPANSION if path.suffix.lower() == ".gguf" else 1
        return path.stat().st_size * factor
    if path.is_dir() and is_safetensors_folder(path):
        return sum(f.stat().st_size for f in path.glob("*.safetensors"))
    return None


__all__ = ["SafetensorsSource", "TensorEntry", "Prequantized", "prequantized", "read_header",
           "is_safetensors_folder", "weights_on_disk", "DTYPES", "GGUF_EXPANSION", "INDEX_NAME",
           "SINGLE_NAME"]

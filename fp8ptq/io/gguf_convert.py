"""A GGUF file converted to a safetensors checkpoint folder one block at a time.

Every path that quantizes a ``.gguf`` model reads fp8ptq's converted copy of it (a safetensors
folder in the cache, ``fp8ptq.io.loading.gguf_folder``): the in-memory loader, the sequential
(block-by-block) path and ``--max-memory`` routing all see a plain safetensors checkpoint. The
conversion itself must not hold the model: transformers' own ``from_pretrained(gguf_file=...)``
dequantizes every tensor into one dict (float32) and then builds the model from it, about twice
the float32 model at its peak, which is the whole point lost for a model that does not fit.

So the conversion here reuses transformers' pieces and streams:

* the config from the GGUF metadata (``AutoConfig.from_pretrained(..., gguf_file=...)``), the
  architecture built on the meta device (no weights);
* the GGUF -> transformers tensor names from transformers' own map
  (``get_gguf_hf_weights_map``) and its per-architecture ``TensorProcessor`` (Llama's q/k
  un-permutation, the MoE processors that merge or split expert tensors);
* each tensor dequantized by the ``gguf`` package (``gguf.dequantize``), processed, cast to
  float32 (the dtype ``from_pretrained`` gives it here) and handed to fp8ptq's ``ShardWriter``
  (one open shard in memory). Tensors a processor gathers into a shared result (Qwen2-MoE's
  ``gate_up_proj``, built from the ``ffn_gate_exps`` and ``ffn_up_exps`` tensors) are written
  once every tensor of their block (``blk.N.``) has been processed.

Memory is one block's tensors (float32) plus the writer's open shard; the GGUF file is
memory-mapped by ``gguf.GGUFReader`` and the pages read are given back (``MADV_DONTNEED``)
after each block. The result equals ``from_pretrained(gguf_file=...)``'s state dict tensor for
tensor (tested), tied weights written once (as ``save_pretrained`` does).
"""

from __future__ import annotations

import copy
import functools
import mmap
import re
import struct
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import gguf
import numpy as np
import torch
import transformers.modeling_gguf_pytorch_utils as hf_gguf
from gguf import GGUFReader, dequantize
from transformers import AutoConfig, AutoTokenizer, GenerationConfig
from transformers.modeling_gguf_pytorch_utils import (
    TENSOR_PROCESSORS,
    TensorProcessor,
    get_gguf_hf_weights_map,
    read_field,
)

from ..checkpoint.shards import SHARD_BYTES, ShardWriter
from ..errors import DataError, first_line
from ..files.atomic import atomic_dir
from ..model.auto import model_class
from .weights import empty_model

_BLOCK = re.compile(r"blk\.(\d+)\.")


class _ShortRead(Exception):
    """A read past the end of the file: ``end`` the byte it needed, ``tensor`` whose data."""

    def __init__(self, end: int, tensor: str | None):
        super().__init__(end, tensor)
        self.end, self.tensor = end, tensor


class _CheckedReader(GGUFReader):
    """``GGUFReader`` whose reads past the end of the file raise ``_ShortRead`` (numpy would
    otherwise report a short slice as a failed ``view`` or ``reshape``)."""

    def _build_tensors(self, start_offs, fields):
        # each tensor's data starts at start_offs + its offset (parts[5]); parts[1] its name
        self._starts = {int(start_offs + f.parts[5][0]): bytes(f.parts[1]).decode("utf-8",
                                                                                 "replace")
                        for f in fields}
        return super()._build_tensors(start_offs, fields)

    def _get(self, offset, dtype, count=1, override_order=None):
        """gguf's ``_get`` on a plain-array view of the mapping: slicing the ``np.memmap``
        itself makes a memmap object per value (``__array_finalize__``), and a vocabulary's
        strings are ~250,000 values (SmolLM2: 4.1 CPU s to parse the header, 1.0 s this way;
        the same fields and tensors, tested)."""
        data = self.__dict__.get("_flat")
        if data is None:
            data = self._flat = self.data.view(np.ndarray)  # still the file's mapping
        dt = np.dtype(dtype)
        end = offset + dt.itemsize * int(count)
        if end > len(data):
            raise _ShortRead(end, getattr(self, "_starts", {}).get(offset))
        arr = data[offset:end].view(dt)
        order = self.byte_order if override_order is None else override_order
        return arr.view(arr.dtype.newbyteorder(order))


def open_gguf(path: Path) -> GGUFReader:
    """The GGUF header and tensor index, parsed first: a truncated or foreign file fails here,
    with its name, instead of deep inside transformers' converter."""
    try:
        return _CheckedReader(str(path))
    except _ShortRead as e:
        where = (f"tensor {e.tensor} (whose data ends at byte {e.end:,})" if e.tensor else
                 "its header (metadata and tensor index)")
        raise DataError(f"truncated GGUF file {path}: it ends at byte {path.stat().st_size:,}, "
                        f"inside {where}") from None
    except (ValueError, KeyError, IndexError, EOFError, OSError, struct.error) as e:
        raise DataError(f"not a valid GGUF file ({path}): {first_line(e)}") from None


def convert_gguf(gguf_path: Path, target: Path, task: str | None = None, *,
                 max_shard_bytes: int = SHARD_BYTES) -> Path:
    """Write the safetensors folder for ``gguf_path`` at ``target`` (config.json, weights in
    float32, tokenizer, generation config), atomically: a reader never sees half of one, and
    another process that finished the same conversion first keeps its own."""
    reader = open_gguf(gguf_path)
    folder, name = str(gguf_path.parent), gguf_path.name
    with _parsed_once(reader, gguf_path):
        try:
            config = AutoConfig.from_pretrained(folder, gguf_file=name)
            gguf_config = hf_gguf.load_gguf_checkpoint(str(gguf_path))["config"]
        except (ValueError, KeyError, NotImplementedError) as e:
            raise DataError(f"cannot convert {gguf_path}: {first_line(e)}") from None
        architecture = read_field(reader, "general.architecture")[0]
        _complete_config(config, reader, architecture)
        model = empty_model(model_class(config, task or "causal-lm"), config, torch.float32)
        processor = TENSOR_PROCESSORS.get(architecture, TensorProcessor)(config=gguf_config)
        key_map = get_gguf_hf_weights_map(model, processor)
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    with atomic_dir(target, if_exists="keep") as tmp:
        written = _stream_tensors(reader, processor, key_map, ShardWriter(tmp, max_shard_bytes))
        _check_complete(model, written, gguf_path)
        model.config.architectures = [type(model).__name__]
        model.config.save_pretrained(tmp)
        if model.can_generate():
            GenerationConfig.from_model_config(model.config).save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
    return target


@contextmanager
def _parsed_once(reader: GGUFReader, gguf_path: Path) -> Iterator[None]:
    """While the config, the name map and the tokenizer are read: transformers' readers of
    ``gguf_path`` get ``reader`` (already parsed) instead of parsing the file again, its
    metadata-only ``load_gguf_checkpoint`` runs once (a fresh copy per call), and gguf's
    tensor-name table is built once per architecture and depth.

    Why: ``AutoConfig``, ``AutoTokenizer`` and the processor's config each call
    ``load_gguf_checkpoint``, which parses every metadata field of the file (SmolLM2's 49,152
    vocabulary strings and merges: ~5 s of CPU each on the 2-core development machine), and
    ``get_gguf_hf_weights_map`` rebuilds gguf's name table for every submodule it recurses
    into (397 times for SmolLM2, ~8 s). Same results: the parse is of the same bytes, and the
    table depends on the architecture and depth alone. Those modules look these names up when
    called (``from gguf import ...`` inside the functions), which is what is swapped here and
    restored after, so nothing outside the conversion sees a change."""
    target = str(gguf_path)
    real_reader, real_load, real_names = (gguf.GGUFReader, hf_gguf.load_gguf_checkpoint,
                                          gguf.get_tensor_name_map)
    parsed: dict = {}

    def shared_reader(path, *args, **kwargs):
        if str(path) == target and not args and not kwargs:
            return reader
        return real_reader(path, *args, **kwargs)

    def load_once(path, return_tensors=False, **kwargs):
        if str(path) != target or return_tensors or kwargs:
            return real_load(path, return_tensors, **kwargs)
        if not parsed:
            parsed.update(real_load(path))
        return copy.deepcopy(parsed)

    gguf.GGUFReader, hf_gguf.load_gguf_checkpoint = shared_reader, load_once
    gguf.get_tensor_name_map = functools.cache(real_names)
    try:
        yield
    finally:
        gguf.GGUFReader, hf_gguf.load_gguf_checkpoint = real_reader, real_load
        gguf.get_tensor_name_map = real_names


# GGUF metadata (``{architecture}.KEY``) that transformers' GGUF config mapping does not read,
# -> the config attribute it sets where the architecture's config has one. Without these a MoE
# gets its config class's default expert widths (Qwen2-MoE: 1408 / 5632, Qwen1.5-MoE-A2.7B's),
# so any other model of the family (Qwen2-57B-A14B, Qwen3-235B-A22B, ...) fails to load.
_UNMAPPED_FIELDS = {"expert_feed_forward_length": "moe_intermediate_size",
                    "expert_shared_feed_forward_length": "shared_expert_intermediate_size"}


def _complete_config(config, reader: GGUFReader, architecture: str) -> None:
    for key, attribute in _UNMAPPED_FIELDS.items():
        field = f"{architecture}.{key}"
        if field in reader.fields and hasattr(config, attribute):
            setattr(config, attribute, int(read_field(reader, field)[0]))


def _stream_tensors(reader: GGUFReader, processor: TensorProcessor, key_map: dict,
                    writer: ShardWriter) -> dict[str, tuple[int, ...]]:
    """Every GGUF tensor dequantized, processed and written in file order; what a processor
    gathers across tensors is written at the end of each block. Returns the shapes written,
    by name."""
    gathered: dict[str, torch.Tensor] = {}  # filled by the MoE processors
    parsed = {"tensors": gathered}
    written: dict[str, tuple[int, ...]] = {}
    block = None

    def flush():
        writer.add({k: v.to(torch.float32) for k, v in gathered.items()})
        written.update((k, tuple(v.shape)) for k, v in gathered.items())
        gathered.clear()
        _release_pages(reader)

    for tensor in reader.tensors:
        m = _BLOCK.match(tensor.name)
        if (m and m.group(1)) != block:
            flush()
            block = m and m.group(1)
        result = processor.process(weights=dequantize(tensor.data, tensor.tensor_type),
                                   name=tensor.name, tensor_key_mapping=key_map,
                                   parsed_parameters=parsed)
        if result.name is None or result.name not in key_map:
            continue  # gathered by the processor, or not a parameter (e.g. rope_freqs)
        hf_name = key_map[result.name]
        t = torch.from_numpy(np.copy(result.weights)).to(torch.float32)
        writer.add({hf_name: t})
        written[hf_name] = tuple(t.shape)
    flush()
    writer.finish()
    return written


def _check_complete(model, written: dict[str, tuple[int, ...]], gguf_path: Path) -> None:
    """Every parameter of the architecture came from the file (a tied one through its source),
    in the shape the config gives it: ``from_pretrained`` would fill a missing one with random
    values, silently, and a folder whose config disagrees with its tensors would not load."""
    tied = set(getattr(model, "all_tied_weights_keys", None) or {})
    params = dict(model.named_parameters(remove_duplicate=False))
    missing = [n for n in params if n not in written and n not in tied]
    if missing:
        raise DataError(f"{gguf_path}: no tensor for {', '.join(missing[:5])}"
                        + (f" (and {len(missing) - 5} more)" if len(missing) > 5 else ""))
    for n, shape in written.items():
        if n in params and tuple(params[n].shape) != shape:
            raise DataError(f"{gguf_path}: tensor {n} has shape {list(shape)}, but the "
                            f"architecture its metadata describes expects "
                            f"{list(params[n].shape)}")


def _release_pages(reader: GGUFReader) -> None:
    """Give back the file pages read so far: a memory-mapped page that was read counts in the
    process's RSS until it is unmapped or advised away (the file is not changed)."""
    mapped = getattr(reader.data, "_mmap", None)
    if isinstance(mapped, mmap.mmap) and hasattr(mmap, "MADV_DONTNEED"):
        mapped.madvise(mmap.MADV_DONTNEED)


__all__ = ["convert_gguf", "open_gguf"]

"""Safetensors shards written as tensors arrive: peak memory is one shard, not the model.

``ShardWriter(directory, max_shard_bytes)`` takes tensors in the order a caller produces them
(``add``), and writes a shard as soon as the next tensor would push the buffered bytes over the
limit. Shards are filled by the rule huggingface_hub's ``split_torch_state_dict_into_shards``
(what ``save_pretrained`` uses) applies to a whole state dict, in the same order: tensors in
arrival order, a new shard when the next tensor would not fit, a tensor larger than the limit in
a shard of its own. So a checkpoint written in pieces is sharded exactly like one written at
once. ``finish`` then names them as the hub does: one ``model.safetensors``, or
``model-0000i-of-0000N.safetensors`` plus ``model.safetensors.index.json`` (the number of shards
is known only at the end, so shards are written under temporary names and renamed).

Tensors are kept by reference until their shard is written: do not change them in place after
``add``. Within one file the bytes do not depend on the order of ``add`` calls (safetensors
sorts the tensors by dtype and name).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import safetensors.torch as st  # looked up at call time: tests patch save_file
import torch
from huggingface_hub.constants import SAFETENSORS_WEIGHTS_FILE_PATTERN

from ..errors import UsageError
from .names import INDEX_NAME

SHARD_BYTES = 2 * 1024**3  # default: split model.safetensors only above this
_PENDING = "shard-{:05d}.safetensors.part"


class ShardWriter:
    """Stream tensors into safetensors shards of at most ``max_shard_bytes`` each."""

    def __init__(self, directory, max_shard_bytes: int = SHARD_BYTES, *,
                 metadata: dict | None = None):
        if max_shard_bytes <= 0:
            raise UsageError(f"max_shard_bytes must be > 0, got {max_shard_bytes}")
        self.directory = Path(directory)
        self.max_shard_bytes = int(max_shard_bytes)
        self.metadata = {"format": "pt"} if metadata is None else dict(metadata)
        self._current: dict[str, torch.Tensor] = {}
        self._current_bytes = 0
        self._shards: list[tuple[str, list[str]]] = []  # (pending file, its tensor names)
        self._seen: set[str] = set()
        self.total_bytes = 0
        self.peak_buffered_bytes = 0
        self._finished: list[str] | None = None

    def add(self, tensors: dict[str, torch.Tensor]) -> None:
        """Buffer ``tensors`` (moved to CPU, made contiguous), writing full shards as they fill."""
        if self._finished is not None:
            raise UsageError("ShardWriter.add after finish()")
        for name, t in tensors.items():
            if name in self._seen:
                raise UsageError(f"tensor {name} is written twice")
            self._seen.add(name)
            t = t.detach().to("cpu").contiguous()
            size = t.numel() * t.element_size()
            self.total_bytes += size
            if size > self.max_shard_bytes:  # alone, in the order the hub lists it
                self._write({name: t})
                continue
            if self._current and self._current_bytes + size > self.max_shard_bytes:
                self._flush()
            self._current[name] = t
            self._current_bytes += size
            self.peak_buffered_bytes = max(self.peak_buffered_bytes, self._current_bytes)

    def _flush(self) -> None:
        if self._current:
            self._write(self._current)
        self._current, self._current_bytes = {}, 0

    def _write(self, tensors: dict[str, torch.Tensor]) -> None:
        pending = _PENDING.format(len(self._shards) + 1)
        st.save_file(tensors, str(self.directory / pending), metadata=self.metadata)
        self._shards.append((pending, list(tensors)))

    def finish(self) -> list[str]:
        """Write the last shard, give every shard its final name (and write the index when
        there are several); returns the file names, index last."""
        if self._finished is not None:
            return list(self._finished)
        self._flush()
        if not self._shards:  # no tensor at all: an empty, valid file
            self._write({})
        n = len(self._shards)
        weight_map, files = {}, []
        for i, (pending, keys) in enumerate(self._shards, 1):
            final = SAFETENSORS_WEIGHTS_FILE_PATTERN.format(
                suffix="" if n == 1 else f"-{i:05d}-of-{n:05d}")
            os.replace(self.directory / pending, self.directory / final)
            files.append(final)
            weight_map.update(dict.fromkeys(keys, final))
        if n > 1:
            (self.directory / INDEX_NAME).write_text(json.dumps(
                {"metadata": {"total_size": self.total_bytes}, "weight_map": weight_map},
                indent=2))
            files.append(INDEX_NAME)
        self._finished = files
        return list(files)

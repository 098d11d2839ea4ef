"""Checkpoint tensors into a model built without weights, with bounded transient memory.

One loader serves two callers: sequential mode (``fp8ptq.sequential``) loads one block's
tensors at a time, and the in-memory pipeline loads a local safetensors folder on the CPU
(``fp8ptq.loading``) through it instead of ``from_pretrained``.

Why not ``from_pretrained`` on the CPU: it memory-maps every safetensors file and the pages it
reads stay resident (and count in the process's RSS) until the whole model is loaded, on top
of the parameters it converts from them. SmolLM2-135M's GGUF cache (538 MB of float32) loaded
as bfloat16 peaks at 1.17 GB that way, against 0.67 GB when each tensor is read with
safetensors' ``pread`` backend (measured; imports are 0.4 GB of either).

What stays transformers': the key renamings and conversions of the model's own conversion
mapping (``get_model_conversion_mapping``: legacy names, per-expert tensors merged into the
fused 3-D ``...Experts`` parameters of Mixtral / Qwen2-MoE / Qwen3-MoE, ...) are applied by
transformers' own ``convert_and_load_state_dict_in_model``, the function ``from_pretrained``
calls, so the parameters are bit for bit those ``from_pretrained`` gives (tested).
"""

from __future__ import annotations

from contextlib import ExitStack
from pathlib import Path

import torch
from accelerate import init_empty_weights
from safetensors import SafetensorError, safe_open
from torch import nn
from transformers import GenerationConfig
from transformers.conversion_mapping import get_model_conversion_mapping
from transformers.core_model_loading import (
    WeightConverter,
    WeightRenaming,
    convert_and_load_state_dict_in_model,
    dot_natural_key,
    rename_source_key,
)
from transformers.modeling_utils import LoadStateDictConfig

from .errors import DataError, first_line
from .files import read_json

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"


def has_safetensors(folder: str | Path) -> bool:
    folder = Path(folder)
    return (folder / INDEX_NAME).is_file() or (folder / SINGLE_NAME).is_file()


class SafetensorsSource:
    """Tensor name -> file of a (sharded) safetensors checkpoint folder. Tensors are read with
    the ``pread`` backend (no memory map): reading a block costs that block's bytes, and nothing
    of the file stays resident after."""

    def __init__(self, folder: str | Path):
        self.folder = Path(folder)
        index = self.folder / INDEX_NAME
        if index.is_file():
            weight_map = read_json(index).get("weight_map")
            if not isinstance(weight_map, dict):
                raise DataError(f"{index}: not a safetensors index (no weight_map)")
            self.files = {k: self.folder / v for k, v in weight_map.items()}
        else:
            single = self.folder / SINGLE_NAME
            if not single.is_file():
                raise DataError(f"{folder}: no model.safetensors(.index.json); sequential mode "
                                "reads safetensors checkpoints")
            with _opened(single) as f:
                self.files = {k: single for k in f.keys()}

    def names(self) -> list[str]:
        return list(self.files)

    def nbytes(self) -> int:
        """Bytes of tensor data, from the headers (nothing is read)."""
        total = 0
        for path in set(self.files.values()):
            with _opened(path) as f:
                for k in f.keys():
                    s = f.get_slice(k)
                    n = 1
                    for d in s.get_shape():
                        n *= d
                    total += n * _DTYPE_BYTES.get(s.get_dtype(), 4)
        return total

    def read(self, names) -> dict[str, torch.Tensor]:
        """The named tensors, read now."""
        with self.slices(names) as slices:
            return {n: s[...] for n, s in slices.items()}

    def slices(self, names) -> _Slices:
        """A context manager giving ``{name: lazy slice}`` (read when indexed, ``[...]``), the
        files open while it lasts."""
        return _Slices(self, names)


class _Slices:
    def __init__(self, source: SafetensorsSource, names):
        self.source, self.names, self._stack = source, list(names), ExitStack()

    def __enter__(self) -> dict:
        by_file: dict[Path, list[str]] = {}
        for n in self.names:
            by_file.setdefault(self.source.files[n], []).append(n)
        out = {}
        for path, ns in by_file.items():
            f = self._stack.enter_context(_opened(path))
            out.update({n: f.get_slice(n) for n in ns})
        return out

    def __exit__(self, *exc):
        return self._stack.__exit__(*exc)


_DTYPE_BYTES = {"F64": 8, "I64": 8, "U64": 8, "F32": 4, "I32": 4, "U32": 4, "F16": 2,
                "BF16": 2, "I16": 2, "U16": 2, "F8_E4M3": 1, "F8_E5M2": 1, "I8": 1, "U8": 1,
                "BOOL": 1}


class _opened:
    """``safe_open(path, backend="pread")`` with a corrupt or truncated file as one DataError."""

    def __init__(self, path: Path):
        self.path = path

    def __enter__(self):
        try:
            self._f = safe_open(self.path, "pt", backend="pread")
        except SafetensorError as e:
            raise DataError(f"{self.path}: corrupt or truncated safetensors file ({e})") from None
        return self._f.__enter__()

    def __exit__(self, *exc):
        return self._f.__exit__(*exc)


def build_empty(cls, config, dtype: torch.dtype) -> nn.Module:
    """The architecture of ``config`` (``cls``: an Auto class), parameters on the meta device;
    buffers (rotary tables, position ids) are real, as ``from_pretrained`` computes them."""
    with init_empty_weights(include_buffers=False):
        model = cls.from_config(config, dtype=dtype)
    return model.eval()


class CheckpointKeys:
    """Which model tensor each checkpoint tensor becomes, by the model's own conversion
    mapping (a per-expert ``mlp.experts.3.gate_proj.weight`` becomes part of the fused
    ``mlp.experts.gate_up_proj``). Computed from names only."""

    def __init__(self, model: nn.Module, names):
        renamings, converters = _mapping(model)
        meta = model.state_dict()
        self.target: dict[str, str] = {}
        for name in sorted(names, key=dot_natural_key):
            target, _ = rename_source_key(name, renamings, converters, model.base_model_prefix,
                                          meta)
            self.target[name] = target
        self._covered = set(self.target.values())

    def under(self, prefix: str, exclude: str | None = None) -> list[str]:
        """Checkpoint names whose model tensor is under ``prefix`` (and not ``exclude``)."""
        return [n for n, t in self.target.items() if t.startswith(prefix)
                and not (exclude and t.startswith(exclude))]

    def uncovered(self, model: nn.Module) -> list[str]:
        """Model parameters no checkpoint tensor provides (tied ones aside)."""
        tied = set(getattr(model, "all_tied_weights_keys", None) or {})
        return [n for n, _ in model.named_parameters() if n not in self._covered
                and n not in tied]


def _mapping(model: nn.Module) -> tuple[list, list]:
    mapping = get_model_conversion_mapping(model)
    return ([m for m in mapping if isinstance(m, WeightRenaming)],
            [m for m in mapping if isinstance(m, WeightConverter)])


def load_tensors(model: nn.Module, source: SafetensorsSource, names, dtype: torch.dtype) -> None:
    """Load checkpoint tensors ``names`` into ``model`` (meta parameters become real CPU
    tensors) through transformers' conversion."""
    names = list(names)
    if not names:
        return
    config = LoadStateDictConfig(dtype=dtype, weight_mapping=get_model_conversion_mapping(model))
    try:
        with source.slices(names) as slices:
            info, _ = convert_and_load_state_dict_in_model(model, slices, config)
    except SafetensorError as e:  # the header parsed, the data is cut short
        raise DataError(f"{source.folder}: corrupt or truncated safetensors file "
                        f"({first_line(e)})") from None
    if info.mismatched_keys:
        name, got, want = sorted(info.mismatched_keys)[0]
        raise DataError(f"{source.folder}: {name} has shape {tuple(got)} in the checkpoint, the "
                        f"model expects {tuple(want)}")
    if info.conversion_errors:
        name, message = next(iter(info.conversion_errors.items()))
        raise DataError(f"{source.folder}: cannot convert {name}: {message}")


def load_streaming(folder: str | Path, config, cls, dtype: torch.dtype) -> nn.Module | None:
    """The whole model from a local safetensors folder, read tensor by tensor (see the module
    docstring), or None when the checkpoint does not provide every parameter (a head to be
    initialized, an adapter...): then ``from_pretrained`` decides, as it always did."""
    model = build_empty(cls, config, dtype)
    source = SafetensorsSource(folder)
    keys = CheckpointKeys(model, source.names())
    if keys.uncovered(model):
        return None
    load_tensors(model, source, source.names(), dtype)
    model.tie_weights()
    if any(p.is_meta for p in model.parameters()):
        return None
    if model.can_generate() and (Path(folder) / "generation_config.json").is_file():
        model.generation_config = GenerationConfig.from_pretrained(folder)
    return model.eval()

"""Checks of a checkpoint folder before anything is built from it.

A checkpoint is data from elsewhere (a colleague, a hub repository, an edited file): before
``fp8ptq.load`` builds a model from it, every tensor the description promises must be there
with the dtype and shape it implies, every scale must be finite and > 0 (a NaN scale would turn
every output of its module into NaN, silently), the format specs must parse and a
compressed-tensors ``config.json`` must agree with the tensors (transformers and vLLM read the
scheme from there, not from fp8ptq.json). A violation is a ``DataError`` (exit 2) naming the
tensor and the rule, so ``eval`` refuses a broken checkpoint instead of printing a table of NaN.

The checks read the safetensors *headers* (names, dtypes, shapes) and the values of the scale
tensors only, so they cost milliseconds even for a large checkpoint, and ``eval`` runs them on
every checkpoint variant before it evaluates anything.

The rules are data. ``EXPECTATIONS`` maps each section of fp8ptq.json ("modules", "experts",
"taps") to a function listing the tensors one entry implies (``Expect``: key, role, dtypes,
shape); ``SCALE_CHECKS`` maps a scale's storage dtype to its validity rule (float: finite and
> 0; uint8 E8M0: not the NaN code 255). A new tensor kind (group scales, MX blocks, ...) adds an
entry to these tables; nothing else changes.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from ..errors import DataError, UsageError
from ..files.json_files import read_json
from ..formats import FormatSpec, get_format
from ..taps.taps import kv_scales_from_report
from .expect import SCALE_CHECKS, SCALE_DTYPES, Expect, dtype_name, scale_problem  # noqa: F401 - re-exported
from .layouts import Layout, get_layout
from .names import INDEX_NAME, META_NAME, WEIGHTS_NAME

# tensors that hold scales, whatever module kind they belong to (also read by
# fp8ptq.checkpoint.validate)
SCALE_SUFFIXES = ("weight_scale", "input_scale", "k_scale", "v_scale", "_scale")
FORMAT_FIELDS = ("weight_format", "act_format")
_SPEC_FIELDS = ("exponent_bits", "mantissa_bits", "bias", "specials", "subnormals", "rounding")
# safetensors header dtype names
_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16,
           "BF16": torch.bfloat16, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
           "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
           "U8": torch.uint8, "BOOL": torch.bool}


def format_from_facts(facts: dict | None) -> FormatSpec | None:
    """The ``FormatSpec`` an fp8ptq.json format entry describes (registry first, so presets keep
    their names and aliases; rebuilt from the stored fields if the registry disagrees)."""
    if facts is None:
        return None
    try:
        spec = get_format(facts["name"])
    except UsageError:
        spec = None
    stored = {**facts, "mx_scale_rounding": facts.get("mx_scale_rounding") or "floor"}
    if spec is not None and all(getattr(spec, k) == stored[k] for k in
                                (*_SPEC_FIELDS, "mx_block", "mx_scale_rounding") if k in stored):
        return spec
    return FormatSpec(facts["name"], **{k: facts[k] for k in _SPEC_FIELDS},
                      torch_dtype=facts.get("torch_dtype"), mx_block=facts.get("mx_block"),
                      mx_scale_rounding=stored["mx_scale_rounding"])


# --- what each fp8ptq.json entry implies ---------------------------------------------------------


def _kv_scales(report: dict | None) -> Iterable[Expect]:
    for attn, scales in kv_scales_from_report(report or {}).items():
        for key in scales:  # written in the native layout, in compressed-tensors with a scheme
            yield Expect(f"{attn}.{key}", "scale", SCALE_DTYPES, required=False,
                         source="fp8ptq.json taps")


# fp8ptq.json section -> the tensors one of its entries implies (each layout lists its own)
EXPECTATIONS: dict[str, Callable[[str, dict, Layout], Iterable[Expect]]] = {
    "modules": lambda name, entry, layout: layout.expect_gemm(name, entry),
    "experts": lambda name, entry, layout: layout.expect_experts(name, entry),
}


def expectations(meta: dict) -> list[Expect]:
    layout = get_layout(meta["layout"])
    out = [x for section, implied in EXPECTATIONS.items()
           for name, entry in (meta.get(section) or {}).items()
           for x in implied(name, entry, layout)]
    return out + list(_kv_scales(meta.get("taps")))


# --- the tensors: headers, values on demand ----------------------------------------------------


class TensorIndex:
    """Names, dtypes and shapes of a checkpoint's tensors from the safetensors headers; values
    read only when asked (the scales). Or a view of tensors already in memory."""

    def __init__(self, folder: Path | None = None, tensors: dict | None = None):
        self._files: dict[str, Path] = {}
        self._header: dict[str, tuple[torch.dtype | None, list[int]]] = {}
        self._tensors = tensors
        if tensors is not None:
            self._header = {k: (t.dtype, list(t.shape)) for k, t in tensors.items()}
            return
        for file in weight_files(folder):
            try:
                with safe_open(str(file), "pt") as f:
                    for k in f.keys():
                        sl = f.get_slice(k)
                        self._header[k] = (_DTYPES.get(sl.get_dtype()), list(sl.get_shape()))
                        self._files[k] = file
            except SafetensorError as e:
                raise DataError(f"{file}: corrupt or truncated safetensors file ({e})") from None

    def __contains__(self, key: str) -> bool:
        return key in self._header

    def keys(self):
        return self._header.keys()

    def dtype(self, key: str):
        return self._header[key][0]

    def shape(self, key: str) -> list[int]:
        return self._header[key][1]

    def value(self, key: str) -> torch.Tensor:
        if self._tensors is not None:
            return self._tensors[key]
        with safe_open(str(self._files[key]), "pt") as f:
            return f.get_tensor(key)


def weight_files(folder: Path) -> list[Path]:
    """The safetensors files of checkpoint ``folder``: one file, or the shards its index lists."""
    if (folder / WEIGHTS_NAME).is_file():
        return [folder / WEIGHTS_NAME]
    if (folder / INDEX_NAME).is_file():
        index = read_json(folder / INDEX_NAME)
        weight_map = index.get("weight_map")
        if not isinstance(weight_map, dict) or not all(isinstance(f, str)
                                                       for f in weight_map.values()):
            raise DataError(f"{folder / INDEX_NAME}: not a safetensors index (no weight_map "
                            "of tensor -> file)")
        files = sorted(set(weight_map.values()))
        missing = [f for f in files if not (folder / f).is_file()]
        if missing:
            raise DataError(f"{folder / missing[0]} is missing ({INDEX_NAME} lists it)")
        return [folder / f for f in files]
    raise DataError(f"{folder} has no {WEIGHTS_NAME} (or {INDEX_NAME})")


# --- the checks ----------------------------------------------------------------------------------


def verify_checkpoint(folder, meta: dict, config: dict, tensors: dict | None = None) -> None:
    """Raise ``DataError`` on the first violation (tensor name and rule in one line). Reads the
    headers of ``folder``'s safetensors files, or ``tensors`` when they are loaded already."""
    folder = Path(folder)
    _check_formats(folder, meta)
    index = TensorIndex(folder if tensors is None else None, tensors)
    scales = {k for k in index.keys() if k.endswith(SCALE_SUFFIXES)}
    for x in expectations(meta):
        if x.key not in index:
            if x.required:
                raise DataError(f"{folder}: tensor {x.key} is missing ({x.source} needs it)")
            continue
        dtype, shape = index.dtype(x.key), index.shape(x.key)
        if dtype not in x.dtypes:
            raise DataError(f"{folder}: tensor {x.key} is {dtype_name(dtype)}; a "
                            f"{meta['layout']} checkpoint stores its {x.role} as "
                            f"{' or '.join(dtype_name(d) for d in x.dtypes)}")
        if x.shape is not None and list(shape) != list(x.shape):
            raise DataError(f"{folder}: tensor {x.key} has shape {list(shape)}, fp8ptq.json "
                            f"says {list(x.shape)}")
        if x.role == "scale":
            scales.add(x.key)
    for key in sorted(scales):
        problem = scale_problem(index.value(key))
        if problem:
            raise DataError(f"{folder}: tensor {key} {problem}")
    get_layout(meta["layout"]).check_config(folder, meta, config, index)


def _check_formats(folder: Path, meta: dict) -> None:
    for section in EXPECTATIONS:
        for name, entry in (meta.get(section) or {}).items():
            if not isinstance(entry, dict):
                raise DataError(f"{folder}/{META_NAME}: {section} entry {name} is not an object")
            for field in FORMAT_FIELDS:
                try:
                    spec = format_from_facts(entry.get(field))
                except (KeyError, TypeError, ValueError, AttributeError, UsageError) as e:
                    raise DataError(f"{folder}/{META_NAME}: {field} of {name} does not describe "
                                    f"a format ({e})") from None
                if field == "weight_format" and spec is None:
                    raise DataError(f"{folder}/{META_NAME}: {name} has no weight_format")


__all__ = ["verify_checkpoint", "scale_problem", "format_from_facts", "expectations",
           "EXPECTATIONS", "SCALE_CHECKS", "SCALE_SUFFIXES", "Expect", "TensorIndex"]

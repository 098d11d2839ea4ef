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

import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from ..errors import DataError, UsageError, first_line
from ..files import read_json
from ..formats import FormatSpec, get_format
from ..taps import kv_scales_from_report
from .layout import INDEX_NAME, LAYOUT_CT, META_NAME, WEIGHTS_NAME

# tensors that hold scales, whatever module kind they belong to (also read by fp8ptq.validate)
SCALE_SUFFIXES = ("weight_scale", "input_scale", "k_scale", "v_scale", "_scale")
FLOAT_SCALES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)
CT_CODES = {"float": torch.float8_e4m3fn, "int": torch.int8}
FORMAT_FIELDS = ("weight_format", "act_format")
_SPEC_FIELDS = ("exponent_bits", "mantissa_bits", "bias", "specials", "subnormals", "rounding")
# safetensors header dtype names
_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16,
           "BF16": torch.bfloat16, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
           "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
           "U8": torch.uint8, "BOOL": torch.bool}


@dataclass(frozen=True)
class Expect:
    """One tensor an fp8ptq.json entry implies."""

    key: str
    role: str  # "codes" or "scale": scales get their values checked
    dtypes: tuple[torch.dtype, ...]
    shape: list[int] | None = None  # None: any
    required: bool = True
    source: str = ""  # the fp8ptq.json entry that implies it (for the message)


def _float_scale_problem(t: torch.Tensor) -> str | None:
    t = t.float()
    bad = ~torch.isfinite(t) | (t <= 0)
    if t.numel() == 0:
        return "is empty; every scale must be finite and > 0"
    if bool(bad.any()):
        return (f"has {int(bad.sum())} scale value(s) that are NaN, inf, zero or negative; every "
                "scale must be finite and > 0")
    return None


def _e8m0_scale_problem(t: torch.Tensor) -> str | None:
    bad = t == 255  # E8M0's NaN code (OCP MX v1.0, section 5.4.1)
    if bool(bad.any()):
        return f"has {int(bad.sum())} E8M0 scale code(s) 255 (NaN); every scale must be finite"
    return None


SCALE_CHECKS: dict[torch.dtype, Callable[[torch.Tensor], str | None]] = {
    **{d: _float_scale_problem for d in FLOAT_SCALES}, torch.uint8: _e8m0_scale_problem}


def scale_problem(t: torch.Tensor) -> str | None:
    """Why scale tensor ``t`` would decode to NaN / inf / 0, or None when it is valid."""
    check = SCALE_CHECKS.get(t.dtype)
    return None if check is None else check(t)


def format_from_facts(facts: dict | None) -> FormatSpec | None:
    """The ``FormatSpec`` an fp8ptq.json format entry describes (registry first, so presets keep
    their names and aliases; rebuilt from the stored fields if the registry disagrees)."""
    if facts is None:
        return None
    try:
        spec = get_format(facts["name"])
    except UsageError:
        spec = None
    if spec is not None and all(getattr(spec, k) == facts[k] for k in (*_SPEC_FIELDS, "mx_block")
                                if k in facts):
        return spec
    return FormatSpec(facts["name"], **{k: facts[k] for k in _SPEC_FIELDS},
                      torch_dtype=facts.get("torch_dtype"), mx_block=facts.get("mx_block"))


# --- what each fp8ptq.json entry implies ---------------------------------------------------------


def _gemm(name: str, entry: dict, layout: str) -> Iterable[Expect]:
    src = f"fp8ptq.json module {name}"
    if layout == LAYOUT_CT:
        yield Expect(f"{name}.weight", "codes", tuple(CT_CODES.values()),
                     entry.get("weight_codes_shape"), source=src)
    else:
        yield Expect(f"{name}.weight_codes", "codes", (torch.uint8,),
                     entry.get("weight_codes_shape"), source=src)
    yield Expect(f"{name}.weight_scale", "scale", tuple(SCALE_CHECKS),
                 entry.get("weight_scale_shape"), source=src)
    static = entry.get("act_format") and entry.get("act_granularity") == "tensor"
    yield Expect(f"{name}.input_scale", "scale", tuple(SCALE_CHECKS),
                 required=bool(static and entry.get("input_scale") is not None),
                 source=f"{src} (static activations)")


def _experts(name: str, entry: dict, layout: str) -> Iterable[Expect]:
    src = f"fp8ptq.json experts {name}"
    static = entry.get("act_format") and entry.get("act_granularity") == "tensor"
    if entry.get("checkpoint_keys"):  # compressed-tensors: per-expert tensors, runtime names
        for shards in entry["checkpoint_keys"].values():
            for e in range(entry["num_experts"]):
                for key, _lo, _hi in shards:
                    k = key.format(e=e)
                    stem = k.removesuffix("weight")
                    yield Expect(k, "codes", (torch.float8_e4m3fn,), source=src)
                    yield Expect(stem + "weight_scale", "scale", tuple(SCALE_CHECKS), source=src)
                    yield Expect(stem + "input_scale", "scale", tuple(SCALE_CHECKS),
                                 required=bool(static), source=src)
        return
    for proj in entry["projections"]:
        yield Expect(f"{name}.{proj}_codes", "codes", (torch.uint8,),
                     (entry.get("codes_shapes") or {}).get(proj), source=src)
        yield Expect(f"{name}.{proj}_scale", "scale", tuple(SCALE_CHECKS),
                     (entry.get("scale_shapes") or {}).get(proj), source=src)
        yield Expect(f"{name}.{proj}_input_scale", "scale", tuple(SCALE_CHECKS),
                     required=bool(static), source=src)


def _kv_scales(report: dict | None) -> Iterable[Expect]:
    for attn, scales in kv_scales_from_report(report or {}).items():
        for key in scales:  # written in the native layout, in compressed-tensors with a scheme
            yield Expect(f"{attn}.{key}", "scale", tuple(SCALE_CHECKS), required=False,
                         source="fp8ptq.json taps")


# fp8ptq.json section -> the tensors one of its entries implies
EXPECTATIONS: dict[str, Callable[[str, dict, str], Iterable[Expect]]] = {
    "modules": _gemm,
    "experts": _experts,
}


def expectations(meta: dict) -> list[Expect]:
    layout = meta["layout"]
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
            raise DataError(f"{folder}: tensor {x.key} is {_name(dtype)}; a {meta['layout']} "
                            f"checkpoint stores its {x.role} as "
                            f"{' or '.join(_name(d) for d in x.dtypes)}")
        if x.shape is not None and list(shape) != list(x.shape):
            raise DataError(f"{folder}: tensor {x.key} has shape {list(shape)}, fp8ptq.json "
                            f"says {list(x.shape)}")
        if x.role == "scale":
            scales.add(x.key)
    for key in sorted(scales):
        problem = scale_problem(index.value(key))
        if problem:
            raise DataError(f"{folder}: tensor {key} {problem}")
    if meta["layout"] == LAYOUT_CT:
        _check_ct_config(folder, meta, config, index)


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


def _check_ct_config(folder: Path, meta: dict, config: dict, index: TensorIndex) -> None:
    """config.json's ``quantization_config`` (compressed-tensors' own pydantic classes validate
    it) must quantize every module fp8ptq.json lists, with the codes type, weight strategy and
    activation scheme its tensors have."""
    from compressed_tensors.quantization import QuantizationConfig
    from pydantic import ValidationError

    where = f"{folder}/config.json"
    qc = config.get("quantization_config")
    if not isinstance(qc, dict) or qc.get("quant_method") != "compressed-tensors" or \
            not qc.get("config_groups"):
        raise DataError(f"{where} has no compressed-tensors quantization_config, but "
                        f"{META_NAME} says the layout is compressed-tensors")
    try:
        parsed = QuantizationConfig.model_validate(qc)
    except ValidationError as e:
        first = e.errors()[0]
        at = ".".join(str(x) for x in first.get("loc", ()) if "[" not in str(x))
        raise DataError(f"{where}: quantization_config does not validate ({at}: "
                        f"{first.get('msg')})") from None
    except (ValueError, TypeError) as e:
        raise DataError(f"{where}: quantization_config does not validate "
                        f"({first_line(e)})") from None
    ignore = set(parsed.ignore or [])
    for name, entry in (meta.get("modules") or {}).items():
        group = _group_of(name, entry, parsed.config_groups)
        if group is None or name in ignore:
            raise DataError(f"{where}: no quantization_config group quantizes {name}, but its "
                            "tensors are quantized")
        gname, scheme = group
        weights, acts = scheme.weights, scheme.input_activations
        codes = f"{name}.weight"
        want = None if weights is None else \
            CT_CODES.get(str(getattr(weights.type, "value", weights.type)))
        if want is None or index.dtype(codes) != want:
            raise DataError(f"{where}: {gname} says {getattr(weights, 'type', None)} weights, "
                            f"but tensor {codes} is {_name(index.dtype(codes))}")
        strategy = str(getattr(weights.strategy, "value", weights.strategy))
        if strategy != entry.get("weight_granularity"):
            raise DataError(f"{where}: {gname} says {strategy} weight scales, but {META_NAME} "
                            f"says {entry.get('weight_granularity')} for {name}")
        static = acts is not None and not acts.dynamic
        if static and f"{name}.input_scale" not in index:
            raise DataError(f"{where}: {gname} says static activations, but tensor "
                            f"{name}.input_scale is missing")
        if acts is None and entry.get("act_format"):
            raise DataError(f"{where}: {gname} has no input_activations, but {META_NAME} says "
                            f"{name} quantizes its activations")


def _group_of(name: str, entry: dict, groups: dict):
    for gname, scheme in groups.items():
        for target in scheme.targets:
            if target == name or target == entry.get("class") or \
                    (target.startswith("re:") and re.fullmatch(target[3:], name)):
                return gname, scheme
    return None


def _name(dtype) -> str:
    return str(dtype).removeprefix("torch.") if dtype is not None else "an unknown dtype"



__all__ = ["verify_checkpoint", "scale_problem", "format_from_facts", "expectations",
           "EXPECTATIONS", "SCALE_CHECKS", "SCALE_SUFFIXES", "Expect", "TensorIndex"]

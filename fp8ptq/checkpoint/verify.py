"""Checks of a checkpoint folder before anything is built from it.

A checkpoint is data from elsewhere (a colleague, a hub repository, an edited file): before
``fp8ptq.load`` builds a model from it, every tensor the description promises must be there
with the dtype and shape it implies, every scale must be finite and > 0 (a NaN scale would turn
every output of its module into NaN, silently), and the format specs must parse. A violation
is a ``DataError`` (exit 2) naming the tensor and the rule, so ``eval`` refuses a broken
checkpoint instead of printing a table of NaN.

The rules are data: ``SCALE_SUFFIXES`` says which tensors are scales, ``_expected_codes`` what
each module's codes look like per layout; a new tensor kind adds an entry there.
"""

from __future__ import annotations

import torch

from ..errors import DataError

# tensors that hold scales, whatever module kind they belong to
SCALE_SUFFIXES = ("weight_scale", "input_scale", "k_scale", "v_scale", "_scale")
CODE_DTYPES = {"compressed-tensors": (torch.float8_e4m3fn, torch.int8),
               "fp8ptq-native": (torch.uint8,)}


def verify(meta: dict, tensors: dict[str, torch.Tensor], where) -> None:
    """Raise ``DataError`` on the first violation (tensor name and rule in one line)."""
    layout = meta["layout"]
    for name, t in tensors.items():
        if name.endswith(SCALE_SUFFIXES) and t.is_floating_point():
            bad = ~torch.isfinite(t.float()) | (t.float() <= 0)
            if bool(bad.any()):
                raise DataError(f"{where}: tensor {name} has {int(bad.sum())} scale value(s) that "
                                "are NaN, inf, zero or negative; every scale must be finite and > 0")
    for name, entry in (meta.get("modules") or {}).items():
        key, dtypes, shape = _expected_codes(name, entry, layout)
        t = tensors.get(key)
        if t is None:
            raise DataError(f"{where}: tensor {key} is missing (fp8ptq.json lists module {name})")
        if t.dtype not in dtypes:
            raise DataError(f"{where}: tensor {key} is {t.dtype}; a {layout} checkpoint stores "
                            f"codes as {' or '.join(str(d) for d in dtypes)}")
        if shape is not None and list(t.shape) != list(shape):
            raise DataError(f"{where}: tensor {key} has shape {list(t.shape)}, fp8ptq.json says "
                            f"{list(shape)}")
        scale = tensors.get(f"{name}.weight_scale")
        if scale is None:
            raise DataError(f"{where}: tensor {name}.weight_scale is missing")
        want = entry.get("weight_scale_shape")
        if want is not None and list(scale.shape) != list(want):
            raise DataError(f"{where}: tensor {name}.weight_scale has shape "
                            f"{list(scale.shape)}, fp8ptq.json says {want}")
        static = entry.get("act_format") and entry.get("act_granularity") == "tensor"
        if static and entry.get("input_scale") is not None and \
                f"{name}.input_scale" not in tensors:
            raise DataError(f"{where}: tensor {name}.input_scale is missing (static "
                            "activations need one)")


def verify_config(meta: dict, config: dict, where) -> None:
    """A compressed-tensors checkpoint's config.json must say so (transformers and vLLM read
    the scheme from there, not from fp8ptq.json)."""
    if meta["layout"] != "compressed-tensors":
        return
    qc = config.get("quantization_config")
    if not isinstance(qc, dict) or qc.get("quant_method") != "compressed-tensors" or \
            not qc.get("config_groups"):
        raise DataError(f"{where}: config.json has no compressed-tensors quantization_config, "
                        "but fp8ptq.json says the layout is compressed-tensors")


def _expected_codes(name: str, entry: dict, layout: str):
    if layout == "compressed-tensors":
        return f"{name}.weight", CODE_DTYPES[layout], entry.get("weight_codes_shape")
    return f"{name}.weight_codes", CODE_DTYPES["fp8ptq-native"], entry.get("weight_codes_shape")

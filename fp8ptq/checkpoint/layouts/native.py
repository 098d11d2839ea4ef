"""The ``fp8ptq-native`` layout: any format, any GEMM kind, loaded with ``fp8ptq.load``.

A GEMM is ``NAME.weight_codes`` (uint8 ``[out, in]``, the 2-D GEMM view; Conv1D and
convolutions included), ``NAME.weight_scale`` (float32; MX formats: uint8 E8M0 codes
``[out, in / 32]``) and, for static activations, ``NAME.input_scale``;
fused experts are ``NAME.{proj}_codes`` (uint8 ``[E, out, in]``), ``NAME.{proj}_scale`` and
``NAME.{proj}_input_scale`` (``[E]``). The formats (bits, bias, specials, rounding) are in
fp8ptq.json; config.json carries a ``quant_method: fp8ptq`` marker that transformers does not
know (it logs "Unknown quantization type" and skips it) and vLLM refuses.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from ...errors import Fp8ptqError
from ...nn.quant_experts import ProjectionQuant
from ..expect import SCALE_DTYPES, Expect
from ..names import LAYOUT_NATIVE, META_NAME
from .base import (
    GemmQuant,
    Layout,
    ModuleDesc,
    input_scale_tensor,
    read_weight_scale,
    weight_scale_tensor,
)


class NativeLayout(Layout):
    name = LAYOUT_NATIVE
    library_name = "fp8ptq"

    def accepts(self, modules, *, model_type=None):
        return None  # every format and module kind

    def gemm_tensors(self, desc: ModuleDesc, q: GemmQuant) -> dict[str, torch.Tensor]:
        t = {f"{desc.name}.weight_codes": q.codes.detach(),
             f"{desc.name}.weight_scale": weight_scale_tensor(desc, q)}
        if q.input_scale is not None:
            t[f"{desc.name}.input_scale"] = input_scale_tensor(q)
        return t

    def gemm_stored_as(self, desc: ModuleDesc) -> dict:
        return {"weight_codes": "uint8 [out, in]"}

    def experts_tensors(self, desc, projections, *, model_type=None):
        out = {}
        for proj, pq in projections.items():
            out[f"{desc.name}.{proj}_codes"] = pq.codes
            out[f"{desc.name}.{proj}_scale"] = pq.weight_scale
            if pq.input_scale is not None:
                out[f"{desc.name}.{proj}_input_scale"] = pq.input_scale
        return out

    def experts_facts(self, desc, *, model_type=None) -> dict:
        return {"checkpoint_keys": None}

    def quantization_config(self, model, modules, *, kv_scheme=None, attention_targets=(),
                            tool_version="") -> dict:
        return {"quant_method": "fp8ptq", "format": LAYOUT_NATIVE, "version": tool_version,
                "metadata": META_NAME, "load_with": "fp8ptq.load(path)"}

    def read_gemm(self, tensors, name, entry) -> GemmQuant:
        codes = tensors.pop(f"{name}.weight_codes")
        scale = read_weight_scale(tensors.pop(f"{name}.weight_scale"))
        return GemmQuant(codes, scale, tensors.pop(f"{name}.input_scale", None))

    def read_experts(self, tensors, name, entry) -> dict[str, ProjectionQuant]:
        out = {}
        for proj in entry["projections"]:
            codes = tensors.pop(f"{name}.{proj}_codes")
            scale = tensors.pop(f"{name}.{proj}_scale")
            if list(codes.shape) != list(entry["codes_shapes"][proj]) or \
                    codes.dtype != torch.uint8:
                raise Fp8ptqError(f"{name}.{proj}_codes: {codes.dtype} {list(codes.shape)} "
                                  f"differs from fp8ptq.json uint8 {entry['codes_shapes'][proj]}")
            out[proj] = ProjectionQuant(codes, scale.float(),
                                        tensors.pop(f"{name}.{proj}_input_scale", None))
        return out

    def expect_gemm(self, name: str, entry: dict) -> Iterable[Expect]:
        src = f"fp8ptq.json module {name}"
        yield Expect(f"{name}.weight_codes", "codes", (torch.uint8,),
                     entry.get("weight_codes_shape"), source=src)
        yield from gemm_scales(name, entry)

    def expect_experts(self, name: str, entry: dict) -> Iterable[Expect]:
        src = f"fp8ptq.json experts {name}"
        static = entry.get("act_format") and entry.get("act_granularity") == "tensor"
        for proj in entry["projections"]:
            yield Expect(f"{name}.{proj}_codes", "codes", (torch.uint8,),
                         (entry.get("codes_shapes") or {}).get(proj), source=src)
            yield Expect(f"{name}.{proj}_scale", "scale", SCALE_DTYPES,
                         (entry.get("scale_shapes") or {}).get(proj), source=src)
            yield Expect(f"{name}.{proj}_input_scale", "scale", SCALE_DTYPES,
                         required=bool(static), source=src)


def gemm_scales(name: str, entry: dict) -> Iterable[Expect]:
    """The scale tensors of a GEMM entry, the same in every layout so far."""
    src = f"fp8ptq.json module {name}"
    yield Expect(f"{name}.weight_scale", "scale", SCALE_DTYPES,
                 entry.get("weight_scale_shape"), source=src)
    static = entry.get("act_format") and entry.get("act_granularity") == "tensor"
    yield Expect(f"{name}.input_scale", "scale", SCALE_DTYPES,
                 required=bool(static and entry.get("input_scale") is not None),
                 source=f"{src} (static activations)")

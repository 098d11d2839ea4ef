"""Named schemes (``--scheme NAME``): presets of recipe fields under names users of the peers
know, plus fp8ptq's own recipes chosen from measurements (docs/results/studies.md).

A scheme is data: the recipe fields it sets. ``Recipe`` expands it under whatever the user said
explicitly (``--scheme fp8-dynamic --weight-calib gptq`` keeps the scheme's granularities and
takes GPTQ; ``--scheme fp8-dynamic --format hif8`` quantizes HiF8 the FP8_DYNAMIC way), and the
scheme's name stays in the recipe, so ``fp8ptq.json`` and the report say which preset a run
started from. Every field a scheme's identity depends on is set, so a recipe file's values do
not leak into it unnoticed.

The peers' names, and what they mean there:

* ``fp8-static``: llm-compressor / compressed-tensors ``FP8`` (ModelOpt's default FP8 recipe):
  per-tensor weights, static per-tensor activations (calibrated max).
* ``fp8-dynamic``: ``FP8_DYNAMIC``: per-channel weights, dynamic per-token activations; no
  calibration data. vLLM's fastest FP8 path on Ada / Hopper (CUTLASS row-wise scaled GEMM).
* ``fp8-block``: ``FP8_BLOCK`` (DeepSeek-V3 style): 128x128 weight blocks, dynamic 1x128
  activation groups along K.
* ``mxfp8``: OCP MXFP8 (compressed-tensors ``MXFP8``): E4M3 elements, one E8M0 scale per 32
  values along K for weights and activations.
* ``w8a16``: FP8 weights only (per channel), activations in high precision (vLLM: FP8 Marlin).
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import UsageError


@dataclass(frozen=True)
class Scheme:
    name: str
    fields: dict  # recipe fields the scheme sets
    description: str
    peers: str = ""  # what the peers call it
    vllm: str = ""  # how vLLM serves a checkpoint of it ("" = not served)
    evidence: str = ""  # for fp8ptq's own presets: the measurement that chose it


# Fields every scheme pins (what a scheme IS): a recipe file's own values for them would
# otherwise survive under a scheme that means something else.
_PINNED = dict(weight_format=None, act_format=None, weight_granularity="channel",
               act_granularity="tensor", act_calib="max", weight_calib="max")

SCHEMES: dict[str, Scheme] = {s.name: s for s in (
    Scheme("fp8-static", dict(format="e4m3", weight_granularity="tensor",
                              act_granularity="tensor"),
           "E4M3, per-tensor weights, static per-tensor activations (calibrated max)",
           peers="llm-compressor FP8, ModelOpt FP8 (default)",
           vllm="CompressedTensorsW8A8Fp8, static per-tensor scaled GEMM"),
    Scheme("fp8-dynamic", dict(format="e4m3", weight_granularity="channel",
                               act_granularity="token"),
           "E4M3, per-channel weights, dynamic per-token activations (no calibration data)",
           peers="llm-compressor FP8_DYNAMIC, ModelOpt FP8 per-channel-per-token",
           vllm="CompressedTensorsW8A8Fp8, row-wise scaled GEMM"),
    Scheme("fp8-block", dict(format="e4m3", weight_granularity="block", block_size=128,
                             act_granularity="group", act_group_size=128),
           "E4M3, 128x128 weight blocks, dynamic 1x128 activation groups along K",
           peers="llm-compressor FP8_BLOCK, DeepSeek-V3 FP8",
           vllm="CompressedTensorsW8A8Fp8 block-scaled GEMM"),
    Scheme("mxfp8", dict(format="mxfp8"),
           "OCP MXFP8: E4M3 elements, E8M0 scale per 32 values along K (weights and dynamic "
           "activations)", peers="compressed-tensors MXFP8, ModelOpt MXFP8",
           vllm="CompressedTensorsW8A8Mxfp8 (Blackwell)"),
    Scheme("mxfp8-e5m2", dict(format="mxfp8-e5m2"),
           "OCP MXFP8 with E5M2 elements (fp8ptq-native checkpoint)", peers="OCP MX v1.0"),
    Scheme("w8a16", dict(format="e4m3", act_format="none", weight_granularity="channel"),
           "E4M3 per-channel weights only, activations in high precision",
           peers="llm-compressor FP8 W8A16, ModelOpt FP8 weight-only",
           vllm="CompressedTensorsW8A16Fp8 (FP8 Marlin)"),
    Scheme("hif8-pts", dict(format="hif8", weight_granularity="tensor",
                            act_granularity="tensor", act_calib="pow2-search"),
           "HiF8, per-tensor power-of-two scales for weights and activations chosen by the "
           "layer-output search (Luo et al., \"Ascend HiFloat8 Format for Deep Learning\", 2024, "
           "sec. 4.2, Algorithm 1: HiF8_PTS)", peers="Ascend HiF8 PTQ (HiF8_PTS)"),
    Scheme("hif8-cast", dict(format="hif8", weight_granularity="tensor", weight_calib="cast",
                             act_calib="cast"),
           "HiF8 direct cast, no scaling (Luo et al. 2024 sec. 4.2: HiF8_Cast)",
           peers="Ascend HiF8 PTQ (HiF8_Cast)"),
)}


def scheme_names() -> list[str]:
    return list(SCHEMES)


def get_scheme(name: str) -> Scheme:
    key = name.strip().lower().replace("_", "-")
    if key not in SCHEMES:
        raise UsageError(f"unknown scheme {name!r}; valid: {', '.join(SCHEMES)}")
    return SCHEMES[key]


def expand_scheme(name: str) -> dict:
    """The recipe fields scheme ``name`` sets (including the fields every scheme pins), with
    ``scheme`` itself."""
    s = get_scheme(name)
    return {**_PINNED, **s.fields, "scheme": s.name}


def scheme_flags(name: str) -> list[str]:
    """The ``quantize`` flags a scheme stands for (printed in the report)."""
    out = []
    for key, value in get_scheme(name).fields.items():
        flag = "--" + key.replace("_", "-")
        out += [flag, "none" if value is None else str(value)]
    return out


__all__ = ["Scheme", "SCHEMES", "scheme_names", "get_scheme", "expand_scheme", "scheme_flags"]

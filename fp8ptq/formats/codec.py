"""Vectorised codecs: quantize to a format's grid, encode to codes, decode, fake-quantize.

``quantize_values`` rounds real numbers to the nearest representable values of a format (no
scale). ``encode`` turns those into integer codes (uint8 tensors), ``decode`` maps codes back with
a 256-entry table. ``fake_quantize`` is quantize-dequantize with a scale. All work elementwise on
whole tensors, CPU or GPU.

On CPU each of them first asks the C kernels (``fp8ptq.runtime.native``: one fused pass,
bit-identical
to the torch code below, which stays the path for GPUs, autograd and anything the kernels do
not take). torch's own float8 dtypes, and the round-to-nearest-even fast paths through them:
``torch_float8``.
"""

from __future__ import annotations

import torch

from ..runtime import native
from .binades import BinadeTables, binade_tables, exponent_field, native_tables
from .layouts import plain_tensors
from .spec import FormatSpec
from .torch_float8 import _bitwise_round, _native_fast_path, _native_round

# Small lookup tables (a format's values, its binade tables) copied to a device once per
# (table, device, dtype), not once per call: a GPTQ sweep decodes a column at a time, and each
# host-to-device copy of a table would stall the GPU's queue.
_DEVICE_TABLES: dict = {}


def _on_device(table, device: torch.device, move):
    """``move(table)`` (a copy of the CPU lookup ``table`` onto ``device``), made once per
    ``table``, ``device`` and ``move``'s ``key``. Only plain tensors are kept: a tensor
    subclass (a fake or functional tensor of a tracing mode) belongs to that mode's life."""
    if device.type == "cpu":
        return move(table)
    key = (id(table), device, getattr(move, "key", None))
    got = _DEVICE_TABLES.get(key)
    if got is None or got[0] is not table:
        got = (table, plain_tensors(move)(table))
        if type(got[1]) in (torch.Tensor, BinadeTables):
            _DEVICE_TABLES[key] = got
    return got[1]


def _tables_on(spec: FormatSpec, device: torch.device) -> BinadeTables:
    """``binade_tables(spec)`` on ``device`` (see ``_on_device``)."""
    return _on_device(binade_tables(spec), device, lambda t: t.to(device))


def _values_on(spec: FormatSpec, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """The value of each code of ``spec`` as ``dtype`` on ``device`` (see ``_on_device``)."""
    def move(t):
        return t.to(device=device, dtype=dtype)
    move.key = dtype
    return _on_device(spec.layout.values, device, move)


def quantize_values(x: torch.Tensor, spec: FormatSpec, *, rounding: str | None = None,
                    saturate: bool = True, nan_to_zero: bool = False,
                    generator: torch.Generator | None = None) -> torch.Tensor:
    """Round ``x`` to representable values of ``spec`` (float32 result, same shape).

    Overflow saturates to +-max, or with ``saturate=False`` becomes inf (formats with inf) or NaN.
    Infinite inputs follow the same rule. NaN stays NaN unless ``nan_to_zero``.
    """
    rounding = rounding or spec.rounding
    kw = dict(rounding=rounding, saturate=saturate, nan_to_zero=nan_to_zero, generator=generator)
    out = _native(x, spec, native.OUT_VALUES, kw)
    if out is not None:
        return out
    return _elementwise_chunks(_quantize_dense, x, spec, torch.float32, kw)


def _native(x, spec, out_kind, kw, scale=None, out=None, group=0) -> torch.Tensor | None:
    """The C kernel's result (same bits as the torch path), or None where it does not apply.
    ``scale``: float32 [1, 1], [rows, 1] or [1, cols] (``_row_scales``), or with ``group`` > 0
    [rows, groups] (one per ``group`` values of a row); ``out``: a checked buffer to write it
    into (``_out_buffer``)."""
    if not native.supports(x):
        return None
    rounding = kw.get("rounding") or spec.rounding
    tables = native_tables(spec, rounding, kw.get("saturate", True), kw.get("nan_to_zero", False))
    if tables is None:
        return None
    rand = None
    if rounding == "stochastic" and spec.is_float:  # the torch path's draw, same stream
        rand = torch.rand(x.shape, generator=kw.get("generator"), device=x.device)
        if rand.dtype != torch.float32:
            return None
    per_row = scale is not None and (scale.shape[0] > 1 or group > 0)
    per_col = scale is not None and not per_row and scale.shape[1] > 1
    return native.quantize(tables, x, out_kind, scale, per_row, per_col, rand, into=out,
                           group=group)


def _elementwise_chunks(fn, x, spec, out_dtype, kw):
    """Apply the elementwise ``fn`` over flat chunks (``chunk_elements``): bit-identical to one
    call, and on CPU several times faster for big tensors (the dozen float32 temporaries stay
    in cache instead of page-faulting in fresh whole-tensor buffers). Stochastic rounding runs
    in one call so its random stream does not depend on the chunking."""
    chunk = chunk_elements(x.device, CHUNK_ELEMENTS)
    if x.numel() < 2 * chunk or kw.get("rounding") == "stochastic":
        return fn(x, spec, **kw)
    flat = x.reshape(-1)
    out = torch.empty(flat.shape, dtype=out_dtype, device=x.device)
    for start in range(0, flat.numel(), chunk):
        out[start:start + chunk] = fn(flat[start:start + chunk], spec, **kw)
    return out.reshape(x.shape)


def _quantize_dense(x, spec, *, rounding, saturate, nan_to_zero, generator):
    src = x
    x = x.float()
    if not spec.is_float:
        return _quantize_int(x, spec, rounding, generator)
    lay = spec.layout
    a = x.abs()
    field = exponent_field(a)
    t = _tables_on(spec, x.device)
    y = a * t.inv_step.take(field)  # exact: multiplication by a power of two
    whole = torch.floor(y)
    frac = y - whole  # exact for the |y| < 2^24 that matter
    up = _round_up(whole, frac, rounding, src, field - 127, generator)
    q = (whole + up) * t.step.take(field)
    overflow = q > lay.max
    if saturate:
        q = torch.where(overflow, torch.full_like(q, lay.max), q)
    else:
        q = torch.where(overflow, torch.full_like(q, torch.inf if lay.has_inf else torch.nan), q)
    q = torch.copysign(q, x)
    if not lay.has_negative_zero:
        q = torch.where(q == 0, torch.zeros_like(q), q)
    if nan_to_zero:
        q = torch.nan_to_num(q, nan=0.0, posinf=torch.inf, neginf=-torch.inf)
    return q


def _round_up(whole, frac, rounding, src, src_exponent, generator):
    """1.0 where the magnitude rounds up to the next grid point, else 0.0."""
    if rounding == "nearest_even":
        up = (frac > 0.5) | ((frac == 0.5) & (torch.remainder(whole, 2) == 1))
    elif rounding == "half_away":
        up = frac >= 0.5
    elif rounding == "stochastic":
        up = torch.rand(frac.shape, generator=generator, device=frac.device) < frac
    elif rounding == "hybrid":
        # Luo et al. 2024 eq. (3): round half away where the source exponent |E| < 4, simplified
        # stochastic rounding (SR14 for fp32 sources, SR2 for fp16/bf16) elsewhere.
        up = torch.where(src_exponent.abs() < 4, frac >= 0.5, _simplified_sr(frac, src))
    else:
        raise ValueError(f"unknown rounding {rounding!r}")
    return up.to(frac.dtype)


def _simplified_sr(frac, src):
    """Luo et al. 2024 Fig. 2: the threshold comes from the source's own low bits, no RNG.

    SR14 (fp32): fraction F14 = the 14 most significant discarded bits, threshold T14 = the 14
    least significant bits of the fp32 pattern. SR2 (fp16/bf16): F2 = the 2 most significant
    discarded bits, T2 = {LSB, 1} (thresholds 0.25 / 0.75). Rounds up when F >= T; an exactly
    representable input (no discarded bits) never rounds, which the literal F >= T would break
    for SR14 when T14 = 0.
    """
    if src.dtype in (torch.float16, torch.bfloat16):
        f2 = torch.floor(frac * 4)
        t2 = (src.view(torch.int16).to(torch.int32) & 1) * 2 + 1
        return f2 >= t2
    bits = src.float().view(torch.int32)
    f14 = torch.floor(frac * 16384)
    t14 = bits & 0x3FFF
    return (frac > 0) & (f14 >= t14)


def _quantize_int(x, spec, rounding, generator):
    qmax = spec.layout.max
    if rounding == "nearest_even":  # torch.round rounds half to even: one pass instead of ten
        return torch.round(x).clamp_(-qmax, qmax).nan_to_num_(0.0)
    whole = torch.floor(x.abs())
    frac = x.abs() - whole
    q = torch.copysign(whole + _round_up(whole, frac, rounding, x, whole, generator), x)
    return q.clamp_(-qmax, qmax).nan_to_num_(0.0)


def encode(x: torch.Tensor, spec: FormatSpec, *, out: torch.Tensor | None = None,
           **kwargs) -> torch.Tensor:
    """Quantize ``x`` (already divided by its scale) and return the codes as uint8.

    ``out``: a uint8 tensor of ``x``'s shape to write the codes into (and return), as torch's
    ``out=``: repeated calls then reuse one buffer instead of faulting in fresh pages, which on
    a CPU can cost as much as the codec itself for a large output."""
    out = _out_buffer(out, x, torch.uint8)
    rounding = kwargs.get("rounding") or spec.rounding
    kw = dict(kwargs, rounding=rounding)
    got = _native(x, spec, native.OUT_CODES, kw, out=out)
    if got is not None:
        return got
    return _into(out, _elementwise_chunks(_encode_dense, x, spec, torch.uint8, kw))


def _out_buffer(out: torch.Tensor | None, x: torch.Tensor, dtype: torch.dtype
                ) -> torch.Tensor | None:
    """``out`` checked against the result it must hold: ``x``'s shape and device, ``dtype``."""
    if out is not None and (out.shape != x.shape or out.dtype != dtype or
                            out.device != x.device):
        raise ValueError(f"out= must be a {dtype} tensor of shape {tuple(x.shape)} on "
                         f"{x.device}, got {out.dtype} {tuple(out.shape)} on {out.device}")
    return out


def _into(out: torch.Tensor | None, result: torch.Tensor) -> torch.Tensor:
    """The torch path's ``result``, copied into ``out`` where one was given."""
    return result if out is None else out.copy_(result)


def _encode_dense(x: torch.Tensor, spec: FormatSpec, **kwargs) -> torch.Tensor:
    lay = spec.layout
    if _native_fast_path(spec, kwargs):
        codes = _native_round(x, spec, keep_dtype=True).view(torch.uint8)
        return torch.where(torch.isnan(x), lay.nan_code, codes) if lay.has_nan else codes
    q = _quantize_dense(x, spec, **{"saturate": True, "nan_to_zero": False, "generator": None,
                                    **kwargs})
    if not spec.is_float:
        return q.to(torch.int8).view(torch.uint8) if spec.bits == 8 else (
            q.to(torch.int64) & (spec.num_codes - 1)).to(torch.uint8)
    code = _grid_codes(q, spec)
    negative = torch.signbit(q) & ((q != 0) | lay.has_negative_zero)
    code = torch.where(negative, code | lay.sign_bit, code)
    if lay.has_inf:
        code = torch.where(q == torch.inf, lay.inf_code, code)
        code = torch.where(q == -torch.inf, lay.inf_code | lay.sign_bit, code)
    if lay.has_nan:
        code = torch.where(torch.isnan(q), lay.nan_code, code)
    return code.to(torch.uint8)


def _grid_codes(q: torch.Tensor, spec: FormatSpec) -> torch.Tensor:
    """Code of each magnitude of grid values ``q`` (non-finite -> code of 0): the rank of
    ``|q|`` among the grid's magnitudes is arithmetic within its binade, no search."""
    t = _tables_on(spec, q.device)
    a = torch.where(torch.isfinite(q), q.abs(), 0.0)
    field = exponent_field(a)
    rank = (a - t.first.take(field)).mul_(t.inv_step.take(field)).add_(t.first_rank.take(field))
    return t.codes.take(rank.long())


def encode_reference(x: torch.Tensor, spec: FormatSpec, **kwargs) -> torch.Tensor:
    """``encode`` by binary search over the sorted grid (the original codec): slow, kept as
    the reference the fast path is tested against."""
    lay = spec.layout
    q = quantize_values(x, spec, **kwargs)
    if not spec.is_float:
        return encode(x, spec, **kwargs)
    mags = lay.magnitudes.to(q.device)
    idx = torch.searchsorted(mags, torch.where(torch.isfinite(q), q.abs(), 0.0).contiguous())
    code = lay.magnitude_codes.to(q.device)[idx.clamp_(max=len(mags) - 1)]
    negative = torch.signbit(q) & ((q != 0) | lay.has_negative_zero)
    code = torch.where(negative, code | lay.sign_bit, code)
    if lay.has_inf:
        code = torch.where(q == torch.inf, lay.inf_code, code)
        code = torch.where(q == -torch.inf, lay.inf_code | lay.sign_bit, code)
    if lay.has_nan:
        code = torch.where(torch.isnan(q), lay.nan_code, code)
    return code.to(torch.uint8)


def decode(codes: torch.Tensor, spec: FormatSpec, dtype=torch.float32) -> torch.Tensor:
    """Values of uint8 codes (any shape) as ``dtype``."""
    return dequantize(codes, None, spec, dtype)


def dequantize(codes: torch.Tensor, scale, spec: FormatSpec,
               dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``(decode(codes) * scale).to(dtype)``: the float32 value of each code times its scale
    (``scale`` broadcasts against ``codes``; None: no scale), rounded once to ``dtype``. On CPU
    one pass of the C kernel where the scale is one value, one per row or one per column (a
    weight's tensor / channel scales): no int64 index copy of the codes, no float32 copy of the
    result."""
    rows = None if scale is None else _row_scales(codes, scale)
    float32 = scale is None or not torch.is_tensor(scale) or scale.dtype == torch.float32 or \
        scale.dim() == 0  # else torch multiplies in the scale's wider dtype
    if (scale is None or rows is not None) and float32 and codes.dim() > 0 and codes.numel() \
            and spec.layout.values.numel() == 256:  # narrower formats: torch checks the codes
        out = native.decode(spec.layout.values, codes.reshape(-1, codes.shape[-1]), rows,
                            rows is not None and rows.shape[0] > 1,
                            rows is not None and rows.shape[0] == 1 and rows.shape[1] > 1, dtype)
        if out is not None:
            return out.reshape(codes.shape)
    if scale is None:
        return _values_on(spec, codes.device, dtype).take(codes.long())
    values = _values_on(spec, codes.device, torch.float32)  # a float64 table
    return (values.take(codes.long()) * scale).to(dtype)


def encode_scaled(x: torch.Tensor, scale, spec: FormatSpec) -> torch.Tensor:
    """``encode(x.float() / scale, spec)``, on CPU in one pass of the C kernel (the division
    included, from ``x``'s own dtype) where ``scale`` is one float32 value, one per row or one
    per column: no float32 copy of ``x``."""
    rows = _row_scales(x, scale)
    if rows is not None and (not torch.is_tensor(scale) or scale.dtype == torch.float32):
        out = _native(x, spec, native.OUT_CODES, {"rounding": spec.rounding}, rows)
        if out is not None:
            return out
    return encode(x.float() / scale, spec)


def fake_quantize(x: torch.Tensor, scale, spec: FormatSpec, *,
                  out: torch.Tensor | None = None, group_size: int | None = None,
                  **kwargs) -> torch.Tensor:
    """``quantize(x / scale) * scale`` in ``x``'s dtype; ``scale`` broadcasts against ``x``.
    ``out``: a tensor like ``x`` to write the result into (and return; see ``encode``).
    ``group_size``: ``scale`` holds one value per ``group_size`` consecutive values along the
    last dim instead ([..., ceil(C / group_size)]; the last group may be partial): the
    kernels read it as it is, where expanding it to ``x``'s shape would cost a full-size
    scale tensor and the torch path."""
    out = _out_buffer(out, x, x.dtype)
    if group_size is not None:
        return _fake_quantize_groups(x, scale, spec, group_size, out, kwargs)
    rows = _row_scales(x, scale)
    if rows is not None and (not torch.is_tensor(scale) or scale.dtype == torch.float32 or
                             scale.dim() == 0):  # else the torch path divides in float64
        got = _native(x, spec, native.OUT_SAME, kwargs, rows, out)
        if got is not None:
            return got
    return _into(out, _fake_quantize_torch(x, scale, spec, rows, kwargs))


def _fake_quantize_groups(x, scale, spec, group_size, out, kwargs) -> torch.Tensor:
    groups = -(-x.shape[-1] // group_size) if x.dim() else 0
    if x.dim() and tuple(scale.shape) != (*x.shape[:-1], groups):
        raise ValueError(f"a scale per {group_size} values of {tuple(x.shape)} has shape "
                         f"{(*x.shape[:-1], groups)}, got {tuple(scale.shape)}")
    if scale.dtype == torch.float32 and x.numel():
        got = _native(x, spec, native.OUT_SAME, kwargs, scale.reshape(-1, groups), out,
                      group_size)
        if got is not None:
            return got
    full = scale.repeat_interleave(group_size, dim=-1)[..., : x.shape[-1]]
    return _into(out, _fake_quantize_torch(x, full, spec, None, kwargs))


def _fake_quantize_torch(x, scale, spec, rows, kwargs) -> torch.Tensor:
    """``fake_quantize`` in torch operations (GPUs, autograd, what the kernels do not take)."""
    if _native_fast_path(spec, kwargs):
        def rounder(y):
            return _bitwise_round(y, spec)
    else:
        def rounder(y):
            return quantize_values(y, spec, **kwargs)
    if rows is None or x.numel() < 2 * chunk_elements(x.device, CHUNK_ELEMENTS) or \
            kwargs.get("rounding") == "stochastic":
        return (rounder(x.float() / scale) * scale).to(x.dtype)
    return _chunked_fake_quantize(x, rows, rounder)


# Activations are fake-quantized in row chunks of about this many elements: the fp32
# temporaries then stay in cache and come from the allocator's free list; on CPU, whole-tensor
# temporaries of a few MB cost more in page faults than the arithmetic itself.
CHUNK_ELEMENTS = 1 << 16
# On a GPU a chunk is a handful of kernel launches and its temporaries live in no cache, so
# chunks there are large: cache-sized ones cut one 14336 x 4096 weight into ~900 pieces, ~5,000
# launches for one encode (52,363 chunk calls, ~5 s of a 4-block 8B-shaped GPTQ run on an H200).
# 2^24 float32 elements: 64 MB temporaries, four pieces for that weight.
GPU_CHUNK_ELEMENTS = 1 << 24


def chunk_elements(device: torch.device, cpu: int) -> int:
    """Elements per chunk of elementwise work on ``device``: ``cpu`` (a cache-sized count) on a
    CPU, ``GPU_CHUNK_ELEMENTS`` (or ``cpu`` if larger) elsewhere."""
    return cpu if device.type == "cpu" else max(cpu, GPU_CHUNK_ELEMENTS)


def _row_scales(x: torch.Tensor, scale) -> torch.Tensor | None:
    """``scale`` as a tensor that broadcasts against ``x`` viewed as [rows, C] (one value, one
    per row, or one per column), or None when it does not."""
    s = torch.as_tensor(scale, dtype=torch.float32, device=x.device)
    if x.dim() == 0:
        return None
    cols = x.shape[-1]
    if s.numel() == 1:
        return s.reshape(1, 1)
    if s.dim() >= 1 and s.shape[-1] == 1 and s.numel() * cols == x.numel() and \
            tuple(s.shape[:-1]) == tuple(x.shape[:-1]):
        return s.reshape(-1, 1)
    if s.numel() == cols and s.shape[-1] == cols:
        return s.reshape(1, cols)
    return None


def _chunked_fake_quantize(x: torch.Tensor, scale: torch.Tensor, rounder) -> torch.Tensor:
    """``fake_quantize`` computed chunk by chunk of rows: bit-identical, several times faster."""
    x2 = x.reshape(-1, x.shape[-1])
    out = torch.empty_like(x2)
    step = max(1, chunk_elements(x.device, CHUNK_ELEMENTS) // x2.shape[1])
    per_row = scale.shape[0] > 1
    for start in range(0, x2.shape[0], step):
        s = scale[start:start + step] if per_row else scale
        y = x2[start:start + step].to(torch.float32, copy=True).div_(s)
        out[start:start + step] = rounder(y).mul_(s)
    return out.reshape(x.shape)


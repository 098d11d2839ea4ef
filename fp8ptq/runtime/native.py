"""The CPU kernels of ``csrc/`` (C files compiled into one library): built on first use with
the system C compiler, loaded with ctypes, and optional -- every caller keeps its pure-torch
path and takes it when this module says no (no compiler, a non-CPU tensor, an unusual dtype or
layout, ``FP8PTQ_NATIVE=0``).

Why a few small C files and not ``torch.compile`` or a torch C++ extension: it compiles in a
few seconds of CPU (once per machine) with plain ``cc`` (no torch headers, no ninja, nothing
downloaded), is never compiled at import time (the first codec or observer call builds it),
needs nothing at install time (``pip install -e .`` stays the one command), and fuses each
codec and the calibration observer into one pass over memory. The results are bit-identical
to the torch path (same IEEE operations in the same order; ``tests/test_native.py``).

The shared library is cached under ``$FP8PTQ_CACHE`` (default ``~/.cache/fp8ptq``), named by a
hash of every source and header, the flags and the CPU, so an edited file or another machine
rebuilds it. The sources, one file per kernel family (``csrc/codec.c``, ``observe.c``,
``sweep.c``, ``decode.c``, ``threads.c``; shared definitions in ``common.h``, ``scalar.h``,
``vec.h``), are compiled in one ``cc`` call.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import threading
import time
from contextlib import contextmanager
from functools import cache
from pathlib import Path

import torch

log = logging.getLogger("fp8ptq.runtime.native")

SOURCE_DIR = Path(__file__).with_name("csrc")


def sources() -> list[Path]:
    """The C files compiled into the library (headers are included by them)."""
    return sorted(SOURCE_DIR.glob("*.c"))
FLAGS = ("-O3", "-fno-math-errno", "-fno-trapping-math", "-ffp-contract=off", "-fPIC", "-shared",
         "-pthread")
ARCH_FLAGS = ("-march=native",)

# Codes of csrc/common.h's enums.
DTYPES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
ROUNDING = {"nearest_even": 0, "half_away": 1, "stochastic": 2, "hybrid": 3}
OUT_VALUES, OUT_SAME, OUT_CODES = 0, 1, 2

_i32x256 = ctypes.c_int32 * 256


class FormatTables(ctypes.Structure):
    """csrc/common.h's ``fmt_t``: a format flattened to per-exponent-field integer tables."""

    _fields_ = [("step_log2", _i32x256), ("first_bits", _i32x256), ("first_rank", _i32x256),
                ("codes", _i32x256), ("max", ctypes.c_float), ("overflow", ctypes.c_float),
                ("int_max", ctypes.c_float), ("rounding", ctypes.c_int32),
                ("is_int", ctypes.c_int32), ("negzero", ctypes.c_int32),
                ("nan_to_zero", ctypes.c_int32), ("sign_bit", ctypes.c_int32),
                ("has_inf", ctypes.c_int32), ("inf_code", ctypes.c_int32),
                ("has_nan", ctypes.c_int32), ("nan_code", ctypes.c_int32),
                ("code_mask", ctypes.c_int32), ("linear", ctypes.c_int32),
                ("lin_lo", ctypes.c_int32), ("lin_slo", ctypes.c_int32),
                ("lin_hi", ctypes.c_int32), ("mbits", ctypes.c_int32),
                ("lin_codes", ctypes.c_int32), ("lin_code_off", ctypes.c_int32),
                ("packed", ctypes.c_int32), ("code_pack", _i32x256),
                ("tapered", ctypes.c_int32), ("taper_lo", ctypes.c_int32),
                ("taper_hi", ctypes.c_int32), ("taper_w0", ctypes.c_int32),
                ("taper_t", ctypes.c_int32 * 4), ("code_lut", ctypes.c_void_p),
                ("lut_shift", ctypes.c_int32), ("lut_sticky", ctypes.c_int32),
                ("lut_nan", ctypes.c_int32 * 2)]


build_seconds: float | None = None  # how long the first build took in this process (None: cached)
_off = 0  # > 0 inside ``disabled()``


def enabled() -> bool:
    return os.environ.get("FP8PTQ_NATIVE", "1").strip().lower() not in ("0", "false", "no", "off")


@contextmanager
def disabled():
    """Run the pure-torch paths inside this block (the tests compare both; benchmarks time
    both)."""
    global _off
    _off += 1
    try:
        yield
    finally:
        _off -= 1


def cache_dir() -> Path:
    root = os.environ.get("FP8PTQ_CACHE") or Path(
        os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "fp8ptq"
    return Path(root) / "native"


def _cpu_identity() -> str:
    """What ``-march=native`` depends on: the CPU's model and flags."""
    try:
        text = Path("/proc/cpuinfo").read_text(errors="replace")
        lines = [ln for ln in text.splitlines() if ln.split(":")[0].strip() in
                 ("model name", "flags", "Features", "CPU part")]
        return "\n".join(sorted(set(lines)))
    except OSError:
        return platform.processor()


def build(cc: str, out: Path, flags: tuple[str, ...]) -> bool:
    """Compile ``csrc/*.c`` to ``out``: into a private temporary beside it, then one atomic
    rename, so processes building at once (torchrun ranks, parallel test workers) each install a
    complete library and a reader never sees a half-written one. False when the build fails."""
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        fd, name = tempfile.mkstemp(dir=out.parent, prefix=f".{out.name}.", suffix=".tmp")
        os.close(fd)
    except OSError as e:
        log.debug("native cache %s: %s", out.parent, e)
        return False
    tmp = Path(name)
    try:
        r = subprocess.run([cc, *flags, *map(str, sources()), "-o", str(tmp), "-lm"],
                           capture_output=True, text=True, timeout=300)
        if r.returncode != 0:
            log.debug("native build failed (%s): %s", " ".join(flags), r.stderr[-2000:])
            return False
        os.replace(tmp, out)  # atomic: concurrent builders (torchrun ranks) agree
        return True
    except (OSError, subprocess.SubprocessError) as e:
        log.debug("native build failed: %s", e)
        return False
    finally:
        tmp.unlink(missing_ok=True)


def library_path(cc: str, flags: tuple[str, ...]) -> Path:
    """Where the library built by ``cc`` with ``flags`` from the current sources is cached."""
    files = sorted(p for p in SOURCE_DIR.iterdir() if p.suffix in (".c", ".h"))
    parts = [part for p in files for part in (p.name.encode(), p.read_bytes())]
    key = hashlib.sha256(b"\0".join([*parts, " ".join(flags).encode(), cc.encode(),
                                     _cpu_identity().encode()])).hexdigest()[:20]
    return cache_dir() / f"fp8ptq_native_{key}.so"


_lock = threading.Lock()


@cache
def library() -> ctypes.CDLL | None:
    """The loaded kernels, building them if needed; None when unavailable (the callers then
    use their torch path, and one INFO line on the ``fp8ptq.runtime.native`` logger says why)."""
    with _lock:  # one build per process even when threads ask at once
        return _load()


def _load() -> ctypes.CDLL | None:
    global build_seconds
    if not enabled() or not sources():
        return None
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc") or shutil.which(
        "clang")
    if cc is None:
        log.info("no C compiler found: the pure-torch codecs and observers run (slower)")
        return None
    for flags in (FLAGS + ARCH_FLAGS, FLAGS):
        path = library_path(cc, flags)
        if not path.is_file():
            t0 = time.perf_counter()
            if not build(cc, path, flags):
                continue
            build_seconds = time.perf_counter() - t0
        try:
            lib = ctypes.CDLL(str(path))
        except OSError as e:
            log.debug("cannot load %s: %s", path, e)
            continue
        _declare(lib)
        return lib
    log.info("the C kernels could not be built with %s: the pure-torch codecs "
             "and observers run (slower)", cc)
    return None


def _declare(lib: ctypes.CDLL) -> None:
    p, i32, i64 = ctypes.c_void_p, ctypes.c_int32, ctypes.c_int64
    lib.fp8ptq_quantize.argtypes = [ctypes.POINTER(FormatTables), p, i32, p, i32, p, i32, i32, p,
                                    i64, i64, i64, i32]
    lib.fp8ptq_quantize.restype = None
    lib.fp8ptq_observe.argtypes = [p, i32, i64, i64, p, p, p, i32, i32, i32, i32]
    lib.fp8ptq_observe.restype = ctypes.c_int
    lib.fp8ptq_have_f16.restype = ctypes.c_int
    lib.fp8ptq_weight_sweep.argtypes = [ctypes.POINTER(FormatTables), p, i32, p, p, i32, i64, i64,
                                        p, p, p, p, i32]
    lib.fp8ptq_weight_sweep.restype = ctypes.c_int
    lib.fp8ptq_row_absmax.argtypes = [p, i32, i64, i64, i64, p, i32]
    lib.fp8ptq_row_absmax.restype = None
    lib.fp8ptq_decode.argtypes = [p, p, i64, i64, p, i32, i32, p, i32, i32]
    lib.fp8ptq_decode.restype = None
    lib.fp8ptq_gptq_block.argtypes = [ctypes.POINTER(FormatTables), p, p, p, i64, p, p, p, i64,
                                      i64, p]
    lib.fp8ptq_gptq_block.restype = None
    lib.fp8ptq_gptq_block64.argtypes = lib.fp8ptq_gptq_block.argtypes
    lib.fp8ptq_gptq_block64.restype = None
    lib.fp8ptq_advise_huge.argtypes = [p, i64]
    lib.fp8ptq_advise_huge.restype = None


HUGE_OUTPUT_BYTES = 4 << 20  # outputs this large ask for transparent huge pages


def empty(shape, dtype: torch.dtype) -> torch.Tensor:
    """``torch.empty`` whose pages, for big tensors, are huge pages where the kernel allows."""
    out = torch.empty(shape, dtype=dtype)
    nbytes = out.numel() * out.element_size()
    if nbytes >= HUGE_OUTPUT_BYTES:
        library().fp8ptq_advise_huge(out.data_ptr(), nbytes)
    return out


def available() -> bool:
    return library() is not None


def supports(x: torch.Tensor) -> bool:
    """Whether the kernels read ``x``: a CPU tensor of float32 / bfloat16 (/ float16 where the
    compiler has ``_Float16``)."""
    if _off or x.device.type != "cpu" or x.dtype not in DTYPES or (
            x.requires_grad and torch.is_grad_enabled()):  # autograd needs the torch ops
        return False
    lib = library()
    if lib is None:
        return False
    return x.dtype != torch.float16 or bool(lib.fp8ptq_have_f16())


def quantize(tables: FormatTables, x: torch.Tensor, out_kind: int,
             scale: torch.Tensor | None = None, per_row: bool = False, per_col: bool = False,
             rand: torch.Tensor | None = None, into: torch.Tensor | None = None,
             group: int = 0) -> torch.Tensor:
    """Run the codec kernel over contiguous ``x`` (``supports(x)`` must hold): float32 grid
    values, fake-quantized values in ``x``'s dtype, or uint8 codes. ``scale``: float32,
    contiguous, one value or one per row / column of ``x`` seen as [-1, x.shape[-1]], or with
    ``per_row`` and ``group`` > 0 one per ``group`` values of each row ([rows, ceil(C /
    group)]). ``into``: a tensor of ``x``'s shape and the result's dtype to write into and
    return (written directly where contiguous)."""
    x = x.detach().contiguous()
    dtype = {OUT_VALUES: torch.float32, OUT_SAME: x.dtype, OUT_CODES: torch.uint8}[out_kind]
    direct = into is not None and into.is_contiguous()
    out = into if direct else empty(x.shape, dtype)
    if scale is not None:
        scale = scale.detach().to(torch.float32).contiguous()
    if rand is not None:
        rand = rand.to(torch.float32).contiguous()
    cols = x.shape[-1] if x.dim() else 1
    library().fp8ptq_quantize(ctypes.byref(tables), x.data_ptr(), DTYPES[x.dtype],
                              out.data_ptr(), out_kind,
                              None if scale is None else scale.data_ptr(), int(per_row),
                              int(per_col), None if rand is None else rand.data_ptr(),
                              x.numel(), cols, group, torch.get_num_threads())
    return out if into is None or direct else into.copy_(out)


def row_absmax(w2d: torch.Tensor, group: int = 0) -> torch.Tensor | None:
    """``w2d.abs().amax(dim=1).float()`` of a contiguous float32 / bfloat16 [rows, cols]
    matrix in one pass without a copy of it (NaN in a row gives NaN, as torch), or None where
    the kernels do not apply. ``group`` > 0: the max of each ``group`` consecutive values of
    a row instead, [rows, ceil(cols / group)] (the last group may be partial)."""
    if w2d.dim() != 2 or w2d.dtype not in (torch.float32, torch.bfloat16) or \
            not w2d.is_contiguous() or not supports(w2d) or w2d.shape[1] == 0:
        return None
    rows, cols = w2d.shape
    out = torch.empty(rows, -(-cols // group), dtype=torch.float32) if group > 0 else \
        torch.empty(rows, dtype=torch.float32)
    library().fp8ptq_row_absmax(w2d.data_ptr(), DTYPES[w2d.dtype], rows, cols, max(group, 0),
                                out.data_ptr(), torch.get_num_threads())
    return out


def weight_sweep(tables: FormatTables, w2d: torch.Tensor, scale: torch.Tensor, per_row: bool):
    """``weight_quant.quantize_weight`` in one pass over the contiguous [rows, cols] float32 /
    bfloat16 ``w2d`` (``supports(w2d)`` must hold) with float32 ``scale`` (one value, or one per
    row): ``(codes, signal, noise, amax, nonfinite)`` - uint8 codes of ``w2d / scale``, per-row
    float64 sums of x^2 and of (x - dequantized)^2, per-row float32 max of finite |x|, and the
    count of non-finite values; None where the kernel does not apply (the caller's torch path
    runs)."""
    rows, cols = w2d.shape
    codes = empty((rows, cols), torch.uint8)
    signal = torch.empty(rows, dtype=torch.float64)
    noise = torch.empty(rows, dtype=torch.float64)
    amax = torch.empty(rows, dtype=torch.float32)
    nonfinite = ctypes.c_int64(0)
    rc = library().fp8ptq_weight_sweep(ctypes.byref(tables), w2d.data_ptr(), DTYPES[w2d.dtype],
                                       codes.data_ptr(), scale.data_ptr(), int(per_row), rows,
                                       cols, signal.data_ptr(), noise.data_ptr(),
                                       amax.data_ptr(), ctypes.addressof(nonfinite),
                                       torch.get_num_threads())
    if rc != 0:
        return None
    return codes, signal, noise, amax, int(nonfinite.value)


def decode(table: torch.Tensor, codes2d: torch.Tensor, scale: torch.Tensor | None,
           per_row: bool, per_col: bool, dtype: torch.dtype) -> torch.Tensor | None:
    """``(table[codes2d] * scale).to(dtype)`` in one pass: ``table`` the format's 256 float32
    values, ``codes2d`` contiguous uint8 [rows, cols] on the CPU, ``scale`` float32 (one value,
    one per row or per column; None: no multiplication). None where the kernels do not apply
    (the caller's torch path runs)."""
    if _off or codes2d.device.type != "cpu" or codes2d.dtype != torch.uint8 or \
            codes2d.dim() != 2 or not codes2d.is_contiguous() or dtype not in DTYPES:
        return None
    lib = library()
    if lib is None or dtype == torch.float16 and not lib.fp8ptq_have_f16():
        return None
    table = table.to(torch.float32).contiguous()
    if scale is not None:
        scale = scale.detach().to(torch.float32).contiguous()
    out = empty(codes2d.shape, dtype)
    lib.fp8ptq_decode(table.data_ptr(), codes2d.data_ptr(), codes2d.shape[0], codes2d.shape[1],
                      None if scale is None else scale.data_ptr(), int(per_row), int(per_col),
                      out.data_ptr(), DTYPES[dtype], torch.get_num_threads())
    return out


def observe(x2d: torch.Tensor, channel_amax: torch.Tensor, histogram: torch.Tensor,
            shift: int, first: int) -> int:
    """Fold a contiguous [rows, channels] tensor into running statistics, in place:
    ``channel_amax`` (float32 [channels]) takes the max of finite |x| per channel,
    ``histogram`` (int64 [bins]) the counts of |x| per bin (bin = float32 bits >> shift minus
    ``first - 1``, clamped; non-finite values count as 0). Returns the number of non-finite
    values."""
    nonfinite = ctypes.c_int64(0)
    rc = library().fp8ptq_observe(x2d.data_ptr(), DTYPES[x2d.dtype], x2d.shape[0], x2d.shape[1],
                                  channel_amax.data_ptr(), histogram.data_ptr(),
                                  ctypes.addressof(nonfinite), histogram.numel(), shift, first,
                                  torch.get_num_threads())
    if rc != 0:
        raise MemoryError("fp8ptq native observer: out of memory")
    return int(nonfinite.value)


def gptq_block(tables: FormatTables, values: torch.Tensor, W1: torch.Tensor, U1: torch.Tensor,
               S1: torch.Tensor, err: torch.Tensor, codes: torch.Tensor,
               scratch: torch.Tensor) -> None:
    """One block of GPTQ's column loop in C (``csrc/codec.c``, ``fp8ptq_gptq_block``): the
    same bits as ``fp8ptq.algorithms.gptq.sweep._column_loop``. All float32 (or all float64:
    ``fp8ptq_gptq_block64``) on the CPU except ``codes`` (uint8) and ``scratch`` (float32):
    ``W1`` [b, rows] (updated), ``S1``, ``err``, ``codes`` [b, rows]
    contiguous; ``U1`` [b, b] with unit column stride (a view of the whole factor); ``values``
    the format's 256 code values; ``scratch`` [rows]. Checked by the caller
    (``sweep.native_loop``)."""
    b, rows = W1.shape
    kernel = library().fp8ptq_gptq_block64 if W1.dtype == torch.float64 else \
        library().fp8ptq_gptq_block
    kernel(ctypes.byref(tables), values.data_ptr(), W1.data_ptr(), U1.data_ptr(), U1.stride(0),
           S1.data_ptr(), err.data_ptr(), codes.data_ptr(), b, rows, scratch.data_ptr())

"""What a command used - wall time per stage and peak resident memory - in one format for every
command's timing line and ``--json``: ``quantize``, ``eval``, ``sensitivity`` and ``validate``
print ``time: load 1.2s, quantize 3.4s; peak RSS 812 MiB in quantize`` and put ``seconds``,
``peak_rss_mb`` and ``peak_rss_stage`` (the stage the peak was reached in) in their JSON;
where CUDA was used, the peak GPU memory beside it (``peak GPU ... MiB``, ``peak_gpu_mb``).
Users size machines and CI runners from these numbers, so every command reports them the same way.

Peak RSS is the kernel's high-water mark of this process's resident memory (``getrusage``:
KiB on Linux, bytes on macOS), the number ``/usr/bin/time -v`` prints as "Maximum resident set
size"; it includes everything the process mapped and touched (torch, the model, lm-eval).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import resource
import sys
import time
from contextlib import contextmanager


def peak_rss_mb() -> float:
    """This process's peak resident memory so far, in MiB."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / 2**20 if sys.platform == "darwin" else peak / 1024.0


# The ``timed`` stage whose end first saw this process's peak RSS (``peak_stage``).
_PEAK = {"mb": 0.0, "stage": None}


def peak_stage() -> str | None:
    """The ``timed`` stage during which this process reached its peak RSS; None when the peak
    was reached outside every timed stage. Why: the timing line's one peak reads as the
    quantize step's, and a peak reached while loading (a GGUF dequantized into its cached
    folder on first use, twice the whole quantize's peak for gemma-3-270m) was taken for the
    cost of a recipe option (docs/results.md, "Two families for every default")."""
    return _PEAK["stage"] if _PEAK["mb"] >= peak_rss_mb() else None


def peak_gpu_mb() -> float | None:
    """The peak GPU memory torch's allocator handed out in this process, in MiB (summed over
    the devices it used), or None when CUDA was never used (torch not imported, or CUDA never
    initialized): then there is nothing to report beside the peak RSS. Read from torch's
    allocator statistics (``torch.cuda.max_memory_allocated``): the tensors' own high-water
    mark, not the cached blocks the allocator keeps reserved around them."""
    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_initialized():
        return None
    total = sum(torch.cuda.max_memory_allocated(d) for d in range(torch.cuda.device_count()))
    return total / 2**20


def _glibc(name: str, argtypes: list):
    """glibc's function ``name`` typed for ctypes; None off Linux or off glibc (musl has
    neither ``malloc_trim`` nor ``mallopt``'s M_MMAP_THRESHOLD semantics)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        func = getattr(ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6"), name)
    except (OSError, AttributeError):
        return None
    func.argtypes, func.restype = argtypes, ctypes.c_int
    return func


_TRIM = _glibc("malloc_trim", [ctypes.c_size_t])
_MALLOPT = _glibc("mallopt", [ctypes.c_int, ctypes.c_int])

# glibc ``mallopt`` parameter number (malloc.h) and the value fp8ptq's commands use.
_M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD = 1 << 20


def bound_heap(threshold: int = MMAP_THRESHOLD) -> bool:
    """Serve every allocation of ``threshold`` bytes or more (1 MiB) from its own ``mmap``, so
    that freeing it hands its pages straight back to the kernel; True when it took effect.

    glibc starts with a 128 KiB mmap threshold and raises it, up to 32 MiB, each time a mapped
    block is freed. After the first few freed activation tensors of a calibration forward, the
    1-30 MB tensors every later forward allocates come from the heap arenas instead (one per
    torch thread), where freed blocks interleave with live ones and stay resident:
    ``malloc_trim`` between batches (``release_free_memory``) cannot reach the peak that
    builds inside one forward. Fixing the threshold (which also switches glibc's dynamic
    adjustment off) lowers the calibration peak and makes it repeatable; 1 MiB is as low as a
    smaller threshold and well below 4 MiB (docs/results/memory.md, "Heap and pages"). A user's own
    ``MALLOC_MMAP_THRESHOLD_`` wins (then nothing is changed); a no-op off glibc. Called by the
    ``fp8ptq`` command at start-up and by ``quantize_model`` / ``quantize_sequential``
    (idempotent)."""
    if _MALLOPT is None or "MALLOC_MMAP_THRESHOLD_" in os.environ:
        return False
    return bool(_MALLOPT(_M_MMAP_THRESHOLD, int(threshold)))


# A roomier threshold for a run whose model is small beside the machine's free memory
# (``heap_threshold``): tensors under 32 MiB come from the heap arenas and are reused, not
# mapped and zeroed by the kernel afresh on every allocation.
ROOMY_MMAP_THRESHOLD = 32 << 20
# ... taken when free memory is at least this many times the model's weights, plus ROOMY_SPARE
ROOMY_FACTOR, ROOMY_SPARE = 8, 4 << 30


def heap_threshold(weight_bytes: int | None, budgeted: bool = False,
                   available: int | None = None) -> int:
    """The mmap threshold for a quantize run: ``MMAP_THRESHOLD`` (1 MiB, the bounded heap)
    under a host budget (``budgeted``: ``--max-memory``, the peak must stay inside it) or when
    the model's size (``weight_bytes``) or the free memory is unknown; ``ROOMY_MMAP_THRESHOLD``
    when the free memory (``available``, default ``available_bytes()``) holds ``ROOMY_FACTOR``
    times the weights plus ``ROOMY_SPARE``.

    Why: with every tensor of 1 MiB or more mapped afresh, the kernel zeroes its pages on first
    touch, and a sequential GPTQ quantize of SmolLM2 (the default recipe, 64 x 512 tokens, one
    thread) spent 67 of 397 CPU seconds in the kernel. At 32 MiB the demo's two quantize runs
    side by side took 297-300 s instead of 339 s at a peak RSS of 1.82-1.87 GB instead of 1.28
    GB (docs/results/speed.md, "Main job: work removed"): memory a machine with room to spare
    can give, and one near its limit cannot."""
    if budgeted or weight_bytes is None:
        return MMAP_THRESHOLD
    available = available_bytes() if available is None else available
    if available is None or available < ROOMY_FACTOR * weight_bytes + ROOMY_SPARE:
        return MMAP_THRESHOLD
    return ROOMY_MMAP_THRESHOLD


def available_bytes(path: str = "/proc/meminfo") -> int | None:
    """The kernel's estimate of memory available to a new process (``MemAvailable``), or
    None where it cannot be read."""
    try:
        with open(path, encoding="ascii") as f:
            return next(int(line.split()[1]) * 1024 for line in f
                        if line.startswith("MemAvailable:"))
    except (OSError, StopIteration, ValueError, IndexError):
        return None


HUGEPAGE_TUNABLE = "glibc.malloc.hugetlb=1"
THP_MODE_FILE = "/sys/kernel/mm/transparent_hugepage/enabled"


def _glibc_version() -> tuple[int, int] | None:
    try:
        name, _, version = os.confstr("CS_GNU_LIBC_VERSION").partition(" ")
        major, minor = version.split(".")[:2]
        return (int(major), int(minor)) if name == "glibc" else None
    except (AttributeError, ValueError, OSError, TypeError):
        return None


def _thp_mode(path: str = THP_MODE_FILE) -> str | None:
    """The kernel's transparent-huge-page mode, the bracketed word of ``path``, or None."""
    try:
        text = open(path, encoding="ascii").read()  # noqa: SIM115 (one read, closed by GC)
    except OSError:
        return None
    start, end = text.find("["), text.find("]")
    return text[start + 1:end] if 0 <= start < end else None


def hugepage_env(env: dict[str, str], thp_mode: str | None,
                 glibc: tuple[int, int] | None) -> dict[str, str] | None:
    """The environment to re-execute with so that glibc backs its mmapped blocks with
    transparent huge pages, or None when that would change nothing or is not ours to change:
    glibc older than 2.35 (no such tunable), a kernel whose THP mode is not ``madvise``
    (``always`` already gives them, ``never`` refuses them), or a ``GLIBC_TUNABLES`` the user
    set (theirs wins; set it empty to keep 4 KiB pages)."""
    if glibc is None or glibc < (2, 35) or thp_mode != "madvise" or "GLIBC_TUNABLES" in env:
        return None
    return {**env, "GLIBC_TUNABLES": HUGEPAGE_TUNABLE}


def exec_with_hugepages() -> None:
    """Re-execute this process (the ``fp8ptq`` command, called before it imports torch) with
    glibc's ``glibc.malloc.hugetlb=1``, which glibc reads only at process start; returns when
    there is nothing to do (``hugepage_env``) or torch is already imported (too late to be
    cheap: the new process would import it again).

    Why: ``bound_heap`` serves every allocation of 1 MiB or more from its own ``mmap``, so each
    activation tensor of a forward is faulted in afresh, 4 KiB at a time. With the tunable glibc
    ``madvise``s those mappings for 2 MiB pages (where the kernel's THP mode is ``madvise``):
    far fewer page faults and less system time in calibration at about the same peak RSS
    (docs/results/speed.md, "Huge pages for `bound_heap`"). The exec costs one interpreter start."""
    new_env = hugepage_env(dict(os.environ), _thp_mode(), _glibc_version())
    if new_env is None or "torch" in sys.modules or not getattr(sys, "orig_argv", None):
        return
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, [sys.executable, *sys.orig_argv[1:]], new_env)


# The commands that re-execute with huge pages: measured per command, not assumed. ``quantize``:
# fewer page faults, the same peak RSS. ``eval``: its peak on the 262k-vocabulary bench rose
# with them for no measured speed-up, so it keeps 4 KiB pages (docs/results/speed.md, "Huge pages
# for `bound_heap`").
HUGEPAGE_COMMANDS = frozenset({"quantize"})


def command_name(argv: list[str], value_options: frozenset[str] = frozenset()) -> str | None:
    """The subcommand of a ``fp8ptq ...`` command line: the first argument that is neither an
    option nor the value of one of ``value_options`` (the group's options that take a value;
    ``--opt=value`` needs no entry). Parsed by hand because it must run before click and torch
    are imported (``fp8ptq.cli`` re-executes before importing either)."""
    args = iter(argv[1:])
    for arg in args:
        if arg == "--":
            return next(args, None)
        if not arg.startswith("-"):
            return arg
        if arg in value_options:
            next(args, None)
    return None


def hugepages_for(argv: list[str], value_options: frozenset[str] = frozenset()) -> None:
    """``exec_with_hugepages`` when ``argv``'s subcommand is one of ``HUGEPAGE_COMMANDS``."""
    if command_name(argv, value_options) in HUGEPAGE_COMMANDS:
        exec_with_hugepages()


def release_free_memory() -> None:
    """Hand the heap's free pages back to the kernel (glibc ``malloc_trim(0)``; a no-op
    elsewhere). Tensors of a few MB come from glibc's heap, not from mmap, once its dynamic
    mmap threshold has grown, and a freed tensor in the middle of the heap stays resident:
    over a calibration pass the peak RSS grew batch after batch. Called between calibration
    batches and sequential blocks (a few milliseconds each)."""
    if _TRIM is not None:
        _TRIM(0)


def usage(seconds: dict[str, float]) -> dict:
    """The JSON fields: ``seconds`` (rounded to ms) and ``peak_rss_mb`` (rounded to 0.1), and
    ``peak_gpu_mb`` beside it whenever CUDA was used (``peak_gpu_mb``)."""
    out = {"seconds": {k: round(v, 3) for k, v in seconds.items()},
           "peak_rss_mb": round(peak_rss_mb(), 1), "peak_rss_stage": peak_stage()}
    gpu = peak_gpu_mb()
    if gpu is not None:
        out["peak_gpu_mb"] = round(gpu, 1)
    return out


def time_line(seconds: dict[str, float], *, min_seconds: float = 0.05, always=()) -> str:
    """``time: load 1.2s, quantize 3.4s; peak RSS 812 MiB`` (and ``, peak GPU 1050 MiB`` when
    CUDA was used): stages shorter than ``min_seconds`` are left out unless named in
    ``always``."""
    parts = [f"{k} {v:.1f}s" for k, v in seconds.items() if v >= min_seconds or k in always]
    gpu = peak_gpu_mb()
    stage = peak_stage()
    memory = f"peak RSS {peak_rss_mb():.0f} MiB" + (f" in {stage}" if stage else "") + (
        "" if gpu is None else f", peak GPU {gpu:.0f} MiB")
    return f"time: {', '.join(parts) or '-'}; {memory}"


@contextmanager
def timed(seconds: dict[str, float], key: str):
    """Add the wall time of the ``with`` body to ``seconds[key]``; a body that raised the
    process's peak RSS becomes its ``peak_stage`` (an inner stage's claim stands: the outer
    one's end sees no higher peak)."""
    t0 = time.perf_counter()
    try:
        yield
    finally:
        seconds[key] = seconds.get(key, 0.0) + time.perf_counter() - t0
        mb = peak_rss_mb()
        if mb > _PEAK["mb"]:
            _PEAK.update(mb=mb, stage=key)


__all__ = ["HUGEPAGE_COMMANDS", "ROOMY_MMAP_THRESHOLD", "available_bytes", "bound_heap",
           "heap_threshold", "command_name", "exec_with_hugepages",
           "hugepage_env", "hugepages_for", "peak_gpu_mb", "peak_rss_mb", "peak_stage",
           "release_free_memory", "time_line", "timed", "usage"]

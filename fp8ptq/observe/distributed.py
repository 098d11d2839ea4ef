"""Data-parallel calibration on torch.distributed (``torchrun --nproc-per-node N fp8ptq ...``).

Every rank loads the model and reads the same calibration set; rank r runs the batches
r, r + N, r + 2N, ... through its copy. Observer statistics are built so that merging them is
exact: running maxima (tensor and per-channel amax) reduce with MAX, element counts and the
HDR histograms (integer counts held in float64, exact below 2^53) with SUM, and the input rows
kept for layer-output-aware calibrators are gathered and put back in global batch order. So
every rank ends with the statistics a single process would have collected, chooses the same
scales, and rank 0 writes a checkpoint identical bit for bit to a single-process run on the
same data (tested with 2 gloo processes).

Failures: a rank that fails inside a calibration pass still takes part in the next agreement
(``agree``), so every rank raises one error naming the failing rank instead of hanging in a
collective; a rank that dies outright is noticed by torchrun, which stops the others.

The backend is gloo on CPU and nccl when the model runs on CUDA (``init``).
"""

from __future__ import annotations

import datetime as _dt
import os

import torch
import torch.distributed as dist

from ..errors import Fp8ptqError
from ..observe.observers import NUM_BINS, TensorStats


def requested() -> bool:
    """Launched by torchrun (or ``python -m torch.distributed.run``) with more than one rank."""
    try:
        return int(os.environ.get("WORLD_SIZE", "1")) > 1
    except ValueError:
        return False


def launched_rank() -> int:
    """This process's rank as torchrun set it (0 outside torchrun), before any process group:
    paths that need no collective (the model-free one) run on rank 0 alone."""
    try:
        return int(os.environ.get("RANK", "0"))
    except ValueError:
        return 0


def init(device: str = "cpu") -> bool:
    """Join the process group torchrun prepared; True when running on several ranks."""
    if not requested() or not dist.is_available():
        return False
    if not dist.is_initialized():
        backend = "nccl" if str(device).startswith("cuda") and torch.cuda.is_available() \
            else "gloo"
        minutes = float(os.environ.get("FP8PTQ_DIST_TIMEOUT_MIN", "30"))
        dist.init_process_group(backend=backend, timeout=_dt.timedelta(minutes=minutes))
        if backend == "nccl":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    return active()


def shutdown() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def active() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def rank() -> int:
    """This process's rank: from the process group, or before/after it from torchrun's env."""
    if active():
        return dist.get_rank()
    try:
        return int(os.environ.get("RANK", "0")) if requested() else 0
    except ValueError:
        return 0


def world() -> int:
    return dist.get_world_size() if active() else 1


def is_main() -> bool:
    return rank() == 0


def shard(batches: list) -> list[tuple[int, object]]:
    """(global index, batch) of this rank's share: batches rank, rank + N, ..."""
    if not active():
        return list(enumerate(batches))
    return [(i, b) for i, b in enumerate(batches) if i % world() == rank()]


def share_indices(n: int, always: int = 0) -> list[int]:
    """Indices of the ``n`` batches this rank needs: its share (as ``shard``) plus the first
    ``always`` ones, which stages that look at a few example batches read on every rank."""
    return [i for i in range(n) if i < always or i % world() == rank()]


def _device() -> torch.device:
    return torch.device("cuda") if dist.get_backend() == "nccl" else torch.device("cpu")


def reduce_stats(stats: dict[str, TensorStats]) -> None:
    """Merge every rank's ``TensorStats`` in place (same keys on every rank)."""
    if not active() or not stats:
        return
    seen: set[int] = set()  # modules sharing one TensorStats (same input) reduce it once
    names = [n for n in sorted(stats) if not (id(stats[n]) in seen or seen.add(id(stats[n])))]
    dev = _device()
    widths = torch.tensor([0 if stats[n].channel_amax is None else stats[n].channel_amax.numel()
                           for n in names], dtype=torch.int64, device=dev)
    dist.all_reduce(widths, op=dist.ReduceOp.MAX)  # a rank that never saw a module has none
    amax = torch.tensor([stats[n].amax for n in names], dtype=torch.float64, device=dev)
    counts = torch.tensor([[stats[n].count, stats[n].nonfinite] for n in names],
                          dtype=torch.int64, device=dev)
    hist = torch.stack([stats[n].histogram for n in names]).to(dev)
    channels = torch.cat([
        torch.zeros(int(w)) if stats[n].channel_amax is None else stats[n].channel_amax.float()
        for n, w in zip(names, widths.tolist())]).to(dev)
    dist.all_reduce(amax, op=dist.ReduceOp.MAX)
    dist.all_reduce(channels, op=dist.ReduceOp.MAX)
    dist.all_reduce(counts)
    dist.all_reduce(hist)
    offset = 0
    for i, (n, w) in enumerate(zip(names, widths.tolist())):
        st = stats[n]
        st.amax = float(amax[i])
        st.count, st.nonfinite = int(counts[i, 0]), int(counts[i, 1])
        st.histogram = hist[i].cpu().clone()
        st.channel_amax = channels[offset:offset + w].cpu().clone() if st.count else None
        offset += w
    assert hist.shape[-1] == NUM_BINS


def reduce_sums(sums: dict[str, torch.Tensor], counts: dict[str, int]) -> None:
    """SUM-reduce accumulators (GPTQ's Hessians) and their row counts in place. Float64 sums
    in another order: equal to a single process to rounding, not bit for bit."""
    if not active() or not sums:
        return
    dev = _device()
    for name in sorted(sums):
        home = sums[name].device  # the host, or the GPU a sequential group's sums stay on
        t = sums[name].to(dev)
        dist.all_reduce(t)
        sums[name] = t.to(home)
    names = sorted(counts)
    c = torch.tensor([counts[n] for n in names], dtype=torch.int64, device=dev)
    dist.all_reduce(c)
    counts.update({n: int(v) for n, v in zip(names, c.tolist())})


def gather_samples(samples: dict[str, list[tuple[int, torch.Tensor]]]
                   ) -> dict[str, list[tuple[int, torch.Tensor]]]:
    """Every rank's kept input rows, in global batch order (each entry (batch index, rows))."""
    if not active():
        return samples
    parts: list = [None] * world()
    dist.all_gather_object(parts, {n: [(i, t.cpu()) for i, t in rows]
                                   for n, rows in samples.items()})
    merged: dict[str, list] = {n: [] for n in samples}
    for part in parts:
        for n, rows in part.items():
            merged.setdefault(n, []).extend(rows)
    return {n: sorted(rows, key=lambda r: r[0]) for n, rows in merged.items()}


def agree(error: BaseException | None) -> None:
    """All ranks learn whether any of them failed; then every rank raises the same error (the
    failing rank its own), so none waits forever in the next collective."""
    if not active():
        if error is not None:
            raise error
        return
    messages: list = [None] * world()
    dist.all_gather_object(messages, None if error is None else
                           f"{type(error).__name__}: {error}")
    failed = [(r, m) for r, m in enumerate(messages) if m is not None]
    if error is not None:
        raise error
    if failed:
        r, message = failed[0]
        raise RankFailure(f"rank {r} failed: {message.split(': ', 1)[-1]}")


def together(work, *args):
    """``work(*args)`` on every rank, then ``agree``: a step that runs no collective of its own
    (loading a block, carrying activations on) fails on every rank together instead of leaving
    the others waiting in the next collective. Returns what ``work`` returns."""
    error, result = None, None
    try:
        result = work(*args)
    except Exception as e:  # noqa: BLE001 - re-raised by agree, on every rank
        error = e
    agree(error)
    return result


class RankFailure(Fp8ptqError):
    """Another rank failed; this one stops with it (the exit code of a runtime failure)."""

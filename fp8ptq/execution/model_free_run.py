"""Running a ``ModelFreeJob``: reading, quantizing and writing overlap, memory stays bounded.

The path is bandwidth-bound, so its stages run at once on their own threads (torch releases the
GIL inside its kernels and ``os.preadv`` while reading):

* a reader thread reads each unit's source tensors, in file order;
* ``workers`` compute threads quantize units (torch's own intra-op threads are set to one
  meanwhile: two threads on two chunks beat two threads splitting every small op);
* the calling thread hands each finished unit to the writer in unit order (shards and the
  index come out the same whatever the timing), then drops its codes.

A semaphore admits at most ``workers + 2`` units between the start of their read and the end
of their write, so memory is a few tensors plus the writer's open shard. An exception on any
thread stops the others and is raised in the caller (the writer then removes its temporary).
"""

from __future__ import annotations

import queue
import threading
import time
from pathlib import Path

import torch

from ..checkpoint import CheckpointWriter, choose_layout, describe_plan, model_type_of
from ..config.recipe import Recipe
from ..io.loading import load_tokenizer
from ..nn.quant_experts import QuantExperts
from ..nn.quant_gemm import QuantGemm
from .in_memory import QuantizeResult
from .model_free import ModelFreeJob, UnitOutput

_POLL = 0.1  # seconds between checks of the stop flag while waiting


class _Stages:
    def __init__(self, job: ModelFreeJob, workers: int):
        self.job, self.workers = job, workers
        self.slots = threading.Semaphore(workers + 2)
        self.todo: queue.Queue = queue.Queue()
        self.done: dict[int, UnitOutput] = {}
        self.cond = threading.Condition()
        self.stop = threading.Event()
        self.error: BaseException | None = None
        self.busy = {"read": 0.0, "quantize": 0.0, "write": 0.0}
        self.bytes_read = 0

    def fail(self, e: BaseException) -> None:
        with self.cond:
            if self.error is None:
                self.error = e
            self.stop.set()
            self.cond.notify_all()

    def read(self) -> None:
        try:
            for i, unit in enumerate(self.job.units):
                while not self.slots.acquire(timeout=_POLL):
                    if self.stop.is_set():
                        return
                t0 = time.perf_counter()
                tensors = {s: self.job.source.read_one(s) for s in unit.sources}
                self.busy["read"] += time.perf_counter() - t0
                self.bytes_read += sum(t.numel() * t.element_size() for t in tensors.values())
                self.todo.put((i, unit, tensors))
        except BaseException as e:  # noqa: BLE001 - raised in the caller
            self.fail(e)

    def compute(self) -> None:
        try:
            while not self.stop.is_set():
                try:
                    i, unit, tensors = self.todo.get(timeout=_POLL)
                except queue.Empty:
                    continue
                t0 = time.perf_counter()
                out = self.job.compute(unit, tensors)
                with self.cond:
                    self.busy["quantize"] += time.perf_counter() - t0
                    self.done[i] = out
                    self.cond.notify_all()
        except BaseException as e:  # noqa: BLE001 - raised in the caller
            self.fail(e)

    def next_output(self, i: int) -> UnitOutput:
        with self.cond:
            while i not in self.done and self.error is None:
                self.cond.wait(_POLL)
            if self.error is not None:
                raise self.error
            return self.done.pop(i)


def run(job: ModelFreeJob, writer, *, workers: int = 2, progress=None) -> QuantizeResult:
    """Quantize every unit of ``job`` into ``writer`` (a ``CheckpointWriter``, or anything with
    ``add_modules(model, names, reports)`` and ``add_tensors(dict)``); ``progress()`` is called
    once per unit. Returns the result ``writer.close`` records."""
    workers = max(1, int(workers))
    stages = _Stages(job, workers)
    threads = [threading.Thread(target=stages.read, name="fp8ptq-read", daemon=True)]
    threads += [threading.Thread(target=stages.compute, name=f"fp8ptq-quantize-{k}", daemon=True)
                for k in range(workers)]
    intra = torch.get_num_threads()
    t0 = time.perf_counter()
    outputs = []
    try:
        if workers > 1:
            torch.set_num_threads(1)
        for t in threads:
            t.start()
        for i in range(len(job.units)):
            out = stages.next_output(i)
            t1 = time.perf_counter()
            writer.add_modules(job.model, out.modules, out.reports)
            writer.add_tensors(out.tensors)
            _release(job.model, out.modules)
            out.tensors = {}
            outputs.append(out)
            stages.busy["write"] += time.perf_counter() - t1
            stages.slots.release()
            if progress is not None:
                progress()
        writer.add_tensors(job.buffers())
    finally:
        stages.stop.set()
        for t in threads:
            t.join()
        torch.set_num_threads(intra)
    seconds = time.perf_counter() - t0
    facts = {"units": len(job.units), "workers": workers, "bytes_read": stages.bytes_read,
             "seconds": round(seconds, 3),
             "read_gb_per_s": round(stages.bytes_read / seconds / 1e9, 3) if seconds else None,
             "busy_seconds": {k: round(v, 3) for k, v in stages.busy.items()}}
    return job.result(outputs, {"quantize": seconds}, facts)


def _release(model, names) -> None:
    for name in names:
        q = model.get_submodule(name)
        if isinstance(q, (QuantGemm, QuantExperts)):
            q.release_codes()


def quantize_checkpoint(folder: str | Path, recipe: Recipe, output, *, force: bool = False,
                        task: str | None = None, source: dict | None = None,
                        tool_version: str | None = None, check_factory=None, workers: int = 2,
                        progress=None, job: ModelFreeJob | None = None,
                        max_shard_bytes: int | None = None, extras: dict | None = None
                        ) -> tuple[QuantizeResult, dict]:
    """Quantize the safetensors checkpoint ``folder`` with ``recipe`` into ``output`` without
    building the model; returns the result and the writer's size facts. ``job``: one planned
    already (``ModelFreeJob(folder, recipe)``); ``check_factory(result)``: a check for the
    complete temporary folder (``CheckpointWriter.close``); ``extras``: added to fp8ptq.json's
    extras (the path selection). Nothing is left at ``output`` on failure (an interruption
    included)."""
    job = job or ModelFreeJob(folder, recipe, task=task)
    tokenizer = _tokenizer(job.folder)
    choice = choose_layout(describe_plan(job.plan), model_type=model_type_of(job.model))
    with CheckpointWriter.open(output, choice, force=force,
                               max_shard_bytes=max_shard_bytes) as ckpt:
        result = run(job, ckpt, workers=workers, progress=progress)
        result.extras.update(extras or {})
        sizes = ckpt.close(job.model, recipe, result=result, tokenizer=tokenizer,
                           source=source or {"model": str(folder), "kind": "local",
                                             "path": str(job.folder)},
                           tool_version=tool_version,
                           check=check_factory(result) if check_factory else None)
    return result, sizes


def _tokenizer(folder: Path):
    """The checkpoint's tokenizer, copied into the output as the in-memory path does; a folder
    without one gives a checkpoint without one."""
    if not any((folder / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json",
                                                 "tokenizer.model", "vocab.json")):
        return None
    return load_tokenizer(str(folder), folder)


__all__ = ["run", "quantize_checkpoint"]

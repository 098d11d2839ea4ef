"""Input second moments of GEMMs (``H = sum x x^T``), collected in the calibration pass for GPTQ.

One forward pre-hook per quantized GEMM; GEMMs fed the very same tensor (q/k/v, gate/up) share
one accumulator, since their H is identical. Accumulated in float64 from float32 products, so
large calibration sets do not lose the small eigen-directions GPTQ's Cholesky needs. Memory is
``in_features^2 x 8`` bytes per distinct input (reported by ``nbytes``); a caller that keeps
them long after the pass (``--target-delta``'s sweep) moves them to disk with ``offload``.

``diagonal=True`` keeps only ``diag(H)``, the energy of each input (``in_features x 8`` bytes,
one multiply-add per element instead of a GEMM): all that a weight calibrator that only weights
the rounding error by input (``hmse`` with round to nearest) reads. GPTQ's sweep needs the whole
matrix: a 7B model's 32 layers hold ~44 GB of float64 Hessians, their diagonals ~4 MB.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager

import torch
from torch import nn

from ..model.block_inputs import ActivationStore
from ..model.gemm import CONV_TYPES


class OffloadedSums(Mapping):
    """Accumulated sums on disk: each in a file under ``spill_dir`` (``ActivationStore`` with no
    memory budget), read back whole when asked for and dropped after use by the caller."""

    def __init__(self, sums: dict[str, torch.Tensor], spill_dir=None):
        self._store = ActivationStore(0, spill_dir)
        self._index = {}
        for i, owner in enumerate(list(sums)):
            self._store.put(i, sums.pop(owner))
            self._index[owner] = i

    def __getitem__(self, owner: str) -> torch.Tensor:
        return self._store.get(self._index[owner])

    def __iter__(self) -> Iterator[str]:
        return iter(self._index)

    def __len__(self) -> int:
        return len(self._index)

    def close(self) -> None:
        self._store.close()


# the narrowest column block ``gram`` splits into (128 inputs: its GEMMs keep full speed)
GRAM_BLOCK = 128


def gram(x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """``x^T x`` into ``out`` computing only its upper block triangle, then mirroring it.

    Why: ``x^T x`` is symmetric, and BLAS's ``gemm`` computes both halves. Column blocks of
    ``x`` multiplied with every block from their own on (one GEMM per block row, into the rows
    of ``out``) do 55-65% of the arithmetic; each element is still one dot product over the
    same rows in the same order, so the result is bit for bit ``torch.mm(x.T, x)`` (tested).
    The Hessian products were a fifth of a sequential GPTQ quantize of SmolLM2 on the CPU
    (docs/results/speed.md, "Main job: work removed (2026-11-28)"). Narrow inputs take the
    one GEMM."""
    d = x.shape[1]
    if d < 2 * GRAM_BLOCK:
        return torch.mm(x.T, x, out=out)
    step = max(GRAM_BLOCK, -(-d // 6 // 64) * 64)  # 6 block rows at most: each GEMM stays wide
    starts = range(0, d, step)
    for s in starts:
        torch.mm(x[:, s:s + step].T, x[:, s:], out=out[s:s + step, s:])
    for s in starts:  # the lower triangle: the transposes of the blocks right of the diagonal
        e = min(s + step, d)
        out[e:, s:e].copy_(out[s:e, e:].T)
    return out


class HessianCollector:
    """``on_device``: the sums stay on the device of the inputs (float64 there) instead of
    crossing to host memory at every batch. The one-pass collector keeps every GEMM's Hessian
    at once, so it sums on the CPU, where memory is cheap; sequential GPTQ holds one group's at
    a time and moves it to the GPU for the sweep anyway, so its per-batch device-to-host copy
    of a float32 ``in x in`` matrix and the host's float64 add (for an 8B ``down_proj``,
    822 MB and 205 M additions per batch) buy nothing there."""

    def __init__(self, modules: dict[str, nn.Module], diagonal: bool = False,
                 on_device: bool = False, dtype: torch.dtype = torch.float64):
        self.diagonal, self.on_device, self.dtype = diagonal, on_device, dtype
        self.modules = {n: m for n, m in modules.items() if not isinstance(m, CONV_TYPES)}
        self.sums: dict[str, torch.Tensor] = {}
        self.rows: dict[str, int] = {}
        self.alias: dict[str, str] = {}  # module -> module whose accumulator it shares
        self._last: tuple | None = None  # (input tensor, owner) of the previous hook call
        # (shape, device) -> a float32 buffer each batch's product is written into (see _product)
        self._buffers: dict[tuple, torch.Tensor] = {}

    @contextmanager
    def observing(self):
        handles = [m.register_forward_pre_hook(self._hook(n)) for n, m in self.modules.items()]
        try:
            yield self
        finally:
            for h in handles:
                h.remove()
            self._last = None
            self._buffers.clear()

    def share(self, names: list[str]) -> None:
        """Declare that ``names`` are fed the very same input tensor: the later ones use the
        first one's sums without their hooks having to run (a forward may then stop on entering
        the first one; see ``fp8ptq.algorithms.gptq.sequential``)."""
        for name in names[1:]:
            self.alias[name] = self.alias.get(names[0], names[0])

    def _hook(self, name: str):
        def hook(_module, args):
            if not args or not torch.is_tensor(args[0]):
                return
            x = args[0]
            if self._last is not None and self._last[0] is x:
                self.alias.setdefault(name, self._last[1])
                self._aliased(name)
                return
            owner = self.alias.get(name, name)
            self._last = (x, owner)
            self._accumulate(name, owner, x)

        return hook

    def _aliased(self, name: str) -> None:
        """``name`` turned out to share the previous module's input (nothing to add)."""

    def _accumulate(self, name: str, owner: str, x: torch.Tensor) -> None:
        x2 = self._float(x.detach().reshape(-1, x.shape[-1]))
        if self.diagonal:
            self._add(self.sums, owner, x2.square().sum(dim=0))
        elif self.on_device and self.dtype == torch.float32 and owner in self.sums \
                and x2.device.type != "cpu":
            # float32 sums where the inputs are (a GPU's): the GEMM adds into them, with no
            # ``in x in`` product beside them (822 MB for an 8B ``down_proj``); on the CPU the
            # half-arithmetic ``gram`` and an add are faster
            self.sums[owner].addmm_(x2.T, x2)
        else:
            self._add(self.sums, owner, self._product(x2, x2))
        self.rows[owner] = self.rows.get(owner, 0) + x2.shape[0]

    def _float(self, x: torch.Tensor) -> torch.Tensor:
        """``x.float()``, a bf16 / fp16 CPU input written into a buffer kept for the pass
        (the same values: fresh, its pages were mapped and zeroed at every batch of every
        group, ~3% of a bf16 sequential GPTQ quantize of SmolLM2 in a profile)."""
        if x.dtype == torch.float32 or x.device.type != "cpu" or not x.is_contiguous():
            return x.float()
        key = ("upcast", x.device)
        buf = self._buffers.get(key)
        if buf is None or buf.numel() < x.numel():
            self._buffers.pop(key, None)
            buf = self._buffers[key] = torch.empty(x.numel(), dtype=torch.float32)
        return buf[:x.numel()].view(x.shape).copy_(x)

    def _product(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        """``a^T b`` (float32) written into a buffer kept for the pass, one per shape and
        device. Why: on the CPU every fresh tensor of 1 MiB or more is a new mapping whose pages
        the kernel zeroes on first touch (``fp8ptq.runtime.usage.bound_heap``); a batch's
        ``in x in`` product and its float64 copy were two such tensors per GEMM input per batch.
        (Small beside the forwards' own: no time change measurable on its own,
        docs/results/speed.md, "Sequential GPTQ's speed".)"""
        key = (a.shape[1], b.shape[1], a.device, a.dtype)
        out = self._buffers.get(key)
        if out is None:
            out = self._buffers[key] = torch.empty(key[:2], dtype=a.dtype, device=a.device)
        if a is b and a.device.type == "cpu":
            return gram(a, out)
        return torch.mm(a.T, b, out=out)

    def _add(self, store: dict, owner: str, t: torch.Tensor) -> None:
        """``store[owner] += t`` in ``dtype`` (float64 by default: a float32 product summed in
        place, no float64 copy of it made); crossing to the host first moves half the bytes."""
        t = t if self.on_device else t.cpu()
        if owner in store:
            store[owner].add_(t)
        else:
            store[owner] = t.to(self.dtype, copy=True)

    def hessian(self, name: str) -> torch.Tensor | None:
        """``2 X^T X / rows`` of ``name``'s inputs ([in, in]; with ``diagonal``: its diagonal,
        [in])."""
        return self._scaled(self.sums, name)

    def _scaled(self, store: dict, name: str) -> torch.Tensor | None:
        """``2 x (the owner's sum) / rows``."""
        owner = self.alias.get(name, name)
        h = store.get(owner)
        return None if h is None else 2.0 * h / max(self.rows[owner], 1)

    def _stores(self) -> tuple[dict, ...]:
        return (self.sums,)

    def offload(self, spill_dir=None) -> None:
        """Move the finished sums to files under ``spill_dir`` (default: the system's temporary
        folder); ``hessian`` then reads one back per call. For a caller that keeps them for
        long after the pass and uses a few at a time: ``--target-delta``'s sweep quantizes one
        unit at a time, while every GEMM's float64 Hessian would otherwise stay resident.
        Only the plain sums (not a subclass's other stores)."""
        if isinstance(self.sums, dict):
            self.sums = OffloadedSums(self.sums, spill_dir)

    def release(self) -> None:
        """Drop the sums (and the files ``offload`` wrote)."""
        if isinstance(self.sums, OffloadedSums):
            self.sums.close()
        self.sums = {}

    @property
    def nbytes(self) -> int:
        """Bytes of the sums held in memory (offloaded ones are on disk, not counted)."""
        return sum(h.numel() * h.element_size() for store in self._stores()
                   if isinstance(store, dict) for h in store.values())

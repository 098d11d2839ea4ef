"""``device="cuda"`` tensors on a CPU-only torch, for tests that catch device bugs without a GPU.

``fake_cuda()`` enters a ``FakeTensorMode`` (tensors carry a device, dtype and shape but no
data; every op checks its operands' devices as a CUDA build does and raises the same "Expected
all tensors to be on the same device" error). Real CPU tensors met inside become fake CPU
tensors, so a CPU Hessian beside a "cuda" weight behaves as on a GPU machine.

A fake tensor has no values, so reading one back to Python (``.item()``, ``float(t)``,
``int(t)``, ``bool(t)``, ``.tolist()``, ``torch.equal``) would stop the run.
Those reads are the host syncs a GPU pays for; here each one is COUNTED (``mode.syncs``) and
answered with a neutral value (integers 0, booleans True, floats 1.0: a Cholesky that
succeeded, a finite norm), so a test can both run past a legitimate once-per-layer check and
assert that no sync happens per column or per token.
"""

from __future__ import annotations

import weakref
from contextlib import contextmanager

import torch
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.utils._pytree import tree_leaves

from fp8ptq.runtime import native

CUDA = torch.device("cuda", 0)


class FakeGpuMemory:
    """What a CUDA allocator would hold in the fake mode: the bytes of every live storage of a
    fake ``cuda`` tensor (views and parameters share their storage's count), and their peak
    since ``reset_peak``. A storage is counted from the op that made it until its last
    reference dies (torch keeps one Python object per storage, so a weak reference to it
    lives exactly as long as the storage), as ``torch.cuda.memory_allocated`` counts it
    without the caching allocator's rounding."""

    def __init__(self):
        self.bytes = 0
        self.peak = 0
        self._live: set[int] = set()

    def track(self, t) -> None:
        if not isinstance(t, torch.Tensor) or t.device.type != "cuda":
            return
        storage = t.untyped_storage()
        key = id(storage)
        if key in self._live:
            return
        n = storage.nbytes()
        self._live.add(key)
        self.bytes += n
        self.peak = max(self.peak, self.bytes)
        weakref.finalize(storage, self._drop, key, n)

    def _drop(self, key: int, n: int) -> None:
        self._live.discard(key)
        self.bytes -= n

    def reset_peak(self) -> None:
        self.peak = self.bytes


class CountingFakeMode(FakeTensorMode):
    """``FakeTensorMode`` that answers and counts reads of a value back to the host (a fake
    "cuda" tensor's read fails in the CPU build's device guard before any mode sees it, so the
    reads are replaced on ``FakeTensor`` itself while the mode is active)."""

    READS = ("__int__", "__float__", "__bool__", "__index__", "item", "tolist")

    def __init__(self):
        super().__init__(allow_non_fake_inputs=True)
        self.syncs = 0
        self.gpu = FakeGpuMemory()
        self._saved: dict = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten.equal.default:  # torch.equal: a bool read back to the host
            self.syncs += 1
            return True
        out = super().__torch_dispatch__(func, types, args, kwargs)
        for t in tree_leaves(out):
            self.gpu.track(t)
        return out

    @staticmethod
    def _neutral(t: torch.Tensor):
        return True if t.dtype == torch.bool else 1.0 if t.dtype.is_floating_point else 0

    def __enter__(self):
        # torch re-enters an active mode from inside its own dispatch: only the outermost
        # entry patches FakeTensor and only its exit restores it (a nested entry would save
        # the patched methods as the originals and leave them on FakeTensor for good, where
        # torch.compile's own fake tensors later read them)
        if not _ACTIVE or _ACTIVE[-1] is not self:
            patches = {name: self._read_as(name) for name in self.READS}
            patches.update(copy_=_copy, contiguous=_contiguous, __getitem__=_getitem,
                           __setitem__=_setitem, __invert__=_invert)
            self._saved = {name: FakeTensor.__dict__.get(name) for name in patches}
            for name, fn in patches.items():
                setattr(FakeTensor, name, fn)
        _ACTIVE.append(self)
        return super().__enter__()

    def __exit__(self, *exc):
        _ACTIVE.pop()
        if not _ACTIVE or _ACTIVE[-1] is not self:
            for name, old in self._saved.items():
                if old is None:
                    delattr(FakeTensor, name)
                else:
                    setattr(FakeTensor, name, old)
        return super().__exit__(*exc)

    def _read_as(self, name: str):
        cast = {"__int__": int, "__index__": int, "__float__": float, "__bool__": bool}.get(name)

        def read(t, *_args):
            self.syncs += 1
            value = self._neutral(t)
            if cast:  # a one-element tensor's value, whatever its shape
                return cast(value)
            for n in reversed(t.shape):
                value = [value] * n
            return value
        return read


# Tensor.copy_, .contiguous(), ~, indexing and item assignment of a fake "cuda" tensor stop in
# the CPU build's device guard of their Python bindings; the same aten operators called directly
# run (and check devices as CUDA does: a copy may cross devices, an index tensor may not).
def _copy(dst, src, non_blocking=False):
    return torch.ops.aten.copy_.default(dst, src, non_blocking)


def _invert(t):
    return torch.ops.aten.bitwise_not.default(t)


def _contiguous(t, memory_format=torch.contiguous_format):
    if t.is_contiguous(memory_format=memory_format):
        return t
    return torch.ops.aten.clone.default(t, memory_format=memory_format)


def _getitem(t, index):
    """``t[index]``: ints, slices, None and Ellipsis as views (as torch's), index tensors then
    gathered by ``aten.index`` at the dimensions they stand for. A boolean mask's result has a
    data-dependent shape (a host sync on a GPU): refused."""
    aten = torch.ops.aten
    index = index if isinstance(index, tuple) else (index,)
    if any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in index):
        raise NotImplementedError("fake_cuda: boolean-mask indexing (a host sync)")
    if Ellipsis in index:
        at = index.index(Ellipsis)
        fill = t.dim() - sum(i is not None for i in index if i is not Ellipsis)
        index = index[:at] + (slice(None),) * fill + index[at + 1:]
    dim, gathers = 0, {}
    for i in index:
        if i is None:
            t = aten.unsqueeze.default(t, dim)
            dim += 1
        elif isinstance(i, slice):
            if i != slice(None):
                step = 1 if i.step is None else i.step
                t = aten.slice.Tensor(t, dim, i.start, i.stop, step)
            dim += 1
        elif isinstance(i, torch.Tensor):
            gathers[dim] = i
            dim += 1
        else:
            t = aten.select.int(t, dim, int(i))
    if gathers:
        t = aten.index.Tensor(t, [gathers.get(d) for d in range(max(gathers) + 1)])
    return t


def _setitem(dst, index, value):
    """``dst[index] = value``; a boolean mask (``nonzero`` behind it on a GPU: a host sync) is
    counted as one and applied as the masked fill it amounts to."""
    aten = torch.ops.aten
    if isinstance(index, torch.Tensor):
        if index.dtype == torch.bool:
            _ACTIVE[-1].syncs += 1
            index = index.reshape(*index.shape, *(1,) * (dst.dim() - index.dim()))
            if isinstance(value, torch.Tensor):
                return aten.copy_.default(dst, aten.where.self(index, value, dst))
            return aten.masked_fill_.Scalar(dst, index, value)
        value = value if isinstance(value, torch.Tensor) else aten.scalar_tensor.default(
            value, dtype=dst.dtype, device=dst.device)
        return aten.index_put_.default(dst, [index], value)
    view = _getitem(dst, index)
    if isinstance(value, torch.Tensor):
        aten.copy_.default(view, value)
    else:
        aten.fill_.Scalar(view, value)


_ACTIVE: list = []

@contextmanager
def fake_cuda():
    """A ``CountingFakeMode`` in which ``device="cuda"`` works on this CPU-only build."""
    # fake tensors have no memory for the C kernels to read; autograd's device guard on a
    # "cuda" tensor needs a CUDA build (inference and calibration run without grad anyway)
    with native.disabled(), torch.no_grad(), CountingFakeMode() as mode:
        yield mode

"""Asymmetric GPTQ (``--gptq-asym``): each GEMM's rounding aims at the FLOAT model's output.

Plain sequential GPTQ (``fp8ptq.algorithms.gptq.sequential``) gathers a GEMM's Hessian from the
inputs
``X~`` the partly quantized model gives it and minimises ``||X~ W^T - X~ Q^T||``: it keeps the
layer's output on the inputs it gets, so the error that reached those inputs from the layers
before (and, with dynamic activations, the GEMM's own input rounding) is carried on. Li et al.,
"GPTAQ: Efficient Finetuning-Free Quantization for Asymmetric Calibration", 2025, section 3,
aim at what the float model computes instead, ``X W0^T`` with ``X`` the float model's input
rows: least squares over the calibration rows (rows = tokens)

    ||X~ Q^T - X W0^T||^2 = ||X~ (Q - W*)^T||^2 + const,   W* = W0 (X^T X~) (X~^T X~)^-1,

so the asymmetric problem is plain GPTQ on the target ``W*`` with the Hessian of ``X~``.
Written as ``W* = W0 + W0 (X - X~)^T X~ (X~^T X~ + lambda I)^-1`` the dampening acts on the
correction only: where both streams agree ``W*`` is ``W0`` exactly (``asymmetric_target``).

fp8ptq carries a float stream beside the quantized one (``quantize_in_order``): a float copy
of each block taken before its GEMMs are quantized, fed the float model's hidden states, so
each group's ``X`` and ``X~`` are the same tokens. For GEMMs with dynamic input quantization
``X~`` is ``Q(X~)``, what the quantized GEMM really multiplies (per token / per group scales
are known without calibration; static scales are not, so those inputs stay unquantized here).

Cost over plain sequential GPTQ: one float forward per group and one per block, a second
activation store, and one ``[in, in]`` float64 cross term per group input.
"""

from __future__ import annotations

import torch
from torch import nn

from ...formats.granularity import act_granularity
from ...nn.quant_gemm import fake_quantize_dynamic
from ...observe.hessian import HessianCollector


def input_quantizer(entry):
    """``x -> Q(x)``, the dynamic input quantization the plan entry's GEMM applies at run
    time (per token, or per group: FP8_BLOCK's 1x128, MX formats' blocks); None for
    weight-only or static inputs (their scale is not chosen yet when the Hessians are)."""
    fmt = entry.act_format
    if fmt is None or entry.input is None or entry.input.static:
        return None
    name, size = entry.input.granularity, entry.input.group_size or 128
    if fmt.mx_block is not None:
        name, size = "group", fmt.mx_block
    gran = act_granularity(name, size)

    def quantize(x: torch.Tensor) -> torch.Tensor:
        return fake_quantize_dynamic(x, gran, fmt)

    return quantize


class AsymmetricCollector(HessianCollector):
    """``HessianCollector`` of the quantized stream's inputs ``X~`` (through ``quantizers``,
    name -> ``input_quantizer``) that also sums the cross term ``X^T X~`` with the float
    stream's inputs of the same rows, which ``float_hooks`` records from a float copy of the
    unit run on the same batch just before."""

    def __init__(self, modules: dict[str, nn.Module], quantizers: dict,
                 on_device: bool = False, dtype: torch.dtype = torch.float64):
        super().__init__(modules, on_device=on_device, dtype=dtype)
        self.quantizers = quantizers
        self.cross: dict[str, torch.Tensor] = {}
        self.float_inputs: dict[str, torch.Tensor] = {}

    def float_hooks(self, float_unit: nn.Module, local_names: dict[str, str]):
        """Pre-hooks on the float copies (``local_names``: name -> name inside ``float_unit``)
        recording each one's input for the next quantized forward; returns the handles."""
        def record(name):
            def hook(_module, args):
                if args and torch.is_tensor(args[0]):
                    self.float_inputs[name] = args[0].detach()
            return hook
        return [float_unit.get_submodule(local).register_forward_pre_hook(record(name))
                for name, local in local_names.items()]

    def _accumulate(self, name: str, owner: str, x: torch.Tensor) -> None:
        q = self.quantizers.get(owner)
        xq = (q(x) if q is not None else x).detach().reshape(-1, x.shape[-1]).float()
        xf = self.float_inputs.pop(name).reshape(-1, x.shape[-1]).float()
        if xf.shape != xq.shape:
            raise RuntimeError(f"{name}: float and quantized streams gave different rows")
        self._add(self.sums, owner, self._product(xq, xq))
        self._add(self.cross, owner, self._product(xf, xq))
        self.rows[owner] = self.rows.get(owner, 0) + xq.shape[0]

    def _aliased(self, name: str) -> None:
        self.float_inputs.pop(name, None)

    def cross_term(self, name: str) -> torch.Tensor | None:
        """``2 X^T X~ / rows``: scaled as ``hessian`` is."""
        return self._scaled(self.cross, name)

    def _stores(self) -> tuple[dict, ...]:
        return (self.sums, self.cross)

    def aim(self, name: str, w0: torch.Tensor, damp: float) -> torch.Tensor:
        """``W*`` of ``name`` (float64): ``asymmetric_target`` on its Hessian and cross term."""
        return asymmetric_target(w0, self.hessian(name), self.cross_term(name), damp)


def asymmetric_target(W: torch.Tensor, H: torch.Tensor, C: torch.Tensor,
                      damp: float) -> torch.Tensor:
    """``W* = W0 + W0 (C - H) (H + lambda I)^-1`` [out, in] (float64), with ``H = X~^T X~``,
    ``C = X^T X~`` (the same scaling) and lambda = ``damp`` x mean(diag H): the weight whose
    output on ``X~`` best matches ``W0``'s on ``X``. Inputs that were always zero in ``X~``
    keep ``W0``'s column (nothing there to fit). Computed on ``W``'s device (the collector
    keeps ``H`` and ``C`` on the CPU), with masks instead of boolean indexing (no host sync)."""
    dev = W.device
    W, H, C = W.double(), H.to(dev, torch.float64), C.to(dev, torch.float64)
    dead = torch.diagonal(H) == 0
    D = (C - H).masked_fill_(dead.unsqueeze(0), 0.0)
    L = damped_cholesky(H, damp)
    # (C - H) A^-1 = (A^-1 (C - H)^T)^T, A symmetric
    return W + W @ torch.cholesky_solve(D.T.contiguous(), L).T


def damped_cholesky(H: torch.Tensor, damp: float,
                    dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """Lower Cholesky factor of ``A = H + lambda I`` (in ``dtype``, float64 by default),
    lambda = ``damp`` x mean(diag H), a 1 on the diagonal of inputs that were always zero
    (diag H = 0), more dampening where ``A`` is still not positive definite (as GPTQ's own).
    ``H`` is not modified."""
    H = H.to(dtype)
    dead = torch.diagonal(H) == 0
    mean = float(torch.diagonal(H).mean()) or 1.0
    for factor in (damp, max(damp, 1e-4) * 10, max(damp, 1e-4) * 100):  # as GPTQ's own
        A = H.clone()
        A.diagonal().add_(factor * mean).masked_fill_(dead, 1.0)
        L, info = torch.linalg.cholesky_ex(A)
        del A
        if int(info) == 0:
            return L
    raise ValueError("the Hessian is not positive definite even with heavy dampening")

"""Sink-aware GPTQ (``--gptq-sink W``): each GEMM also keeps the first token's output exact.

A sequence's first token attends only to itself, so in every layer its hidden state is a
function of that one token (the BOS a runtime puts first: the same vector in every request).
Every later token attends to it: it is the attention sink (Xiao et al., "Efficient Streaming
Language Models with Attention Sinks", 2023) and carries the massive activations of Sun et al.,
"Massive Activations in Large Language Models", 2024. Liu et al., "IntactKV: Improving Large
Language Model Quantization by Keeping Pivot Tokens Intact", 2024, show that the quantization
error of that one token's keys and values costs a share of the whole model's loss out of
proportion to its count, and keep its KV cache from the float model. A checkpoint that vLLM
serves cannot ship a KV prefix, so fp8ptq moves the fix into the weights instead.

Plain GPTQ minimises ``sum_t ||(W - Q) x_t||^2`` over the calibration tokens, where the first
token is one row in 512 and the GEMM's own input rounding (dynamic per-token FP8) is not in the
objective at all. Sink-aware GPTQ adds the first rows ``B`` (position 0 of every calibration
sequence) with weight ``lambda`` and their REAL quantized input ``q(x)``:

    sum_t ||(W - Q) x_t||^2 + lambda sum_{b in B} ||Q q(x_b) - W x_b||^2,

a least-squares problem of the asymmetric form (``fp8ptq.algorithms.gptq.asym``), solved the
same way: plain GPTQ with the Hessian ``H~ = H + lambda' mean_B(q q^T)`` on the target
``W* = W C H~^-1``, ``C = H + lambda' mean_B(x q^T)`` (``asymmetric_target``). The correction
``W* - W`` is of the rank of ``B`` (one for BOS-opened windows: every row is the same vector):
``W*`` maps the sink's rounded input to the sink's exact output, and the weighted row in ``H~``
makes the column sweep compensate its own rounding along that direction too.

``weight`` (``lambda'`` above, in units of the whole calibration set): 1 gives the first
tokens together as much weight as all tokens. Only sequential GPTQ; the inputs are the model's
quantized so far (``x_b`` is what the quantized model gives the GEMM, as in plain GPTQ).
"""

from __future__ import annotations

import torch
from torch import nn

from ...observe.hessian import HessianCollector


class SinkCollector(HessianCollector):
    """``HessianCollector`` that also keeps the first position of every batch row (``x[:, 0]``
    of a ``[batch, seq, features]`` input) with ``q``, the GEMM's dynamic input quantization of
    it (``quantizers``: owner -> ``input_quantizer``; None: the input as it is). ``hessian`` and
    ``cross_term`` then give ``H~`` and ``C`` (see the module docstring), scaled as plain
    Hessians are. The first rows are kept as rows (two per sequence, ``[2, n, features]`` per
    call), not as ``features x features`` sums: a 14,336-input ``down_proj`` would otherwise
    hold two more 1.6 GB matrices beside its Hessian. (``nbytes`` counts the Hessians only; the
    rows are ``2 x sequences x features x 4`` bytes.)"""

    def __init__(self, modules: dict[str, nn.Module], quantizers: dict, weight: float,
                 on_device: bool = False):
        super().__init__(modules, on_device=on_device)
        self.quantizers, self.weight = quantizers, weight
        # owner -> [(call index, [2, rows, features]: the inputs x and their rounding q)]
        self.first_rows: dict[str, list[tuple[int, torch.Tensor]]] = {}

    def _accumulate(self, name: str, owner: str, x: torch.Tensor) -> None:
        super()._accumulate(name, owner, x)
        if x.dim() < 3:  # no sequence axis: no first token to single out
            return
        first = x.detach()[:, :1].float()
        q = self.quantizers.get(owner)
        qf = (q(first) if q is not None else first).reshape(-1, x.shape[-1]).float()
        rows = torch.stack([first.reshape(-1, x.shape[-1]), qf])
        rows = rows if self.on_device else rows.cpu()
        kept = self.first_rows.setdefault(owner, [])
        kept.append((len(kept), rows))

    def _with_sink(self, name: str, left: int) -> torch.Tensor | None:
        """``H + 2 weight mean_B(r q^T)`` with ``r`` the kept rows ``left`` (0: x, 1: q)."""
        h = self._scaled(self.sums, name)
        owner = self.alias.get(name, name)
        if h is None or not self.first_rows.get(owner):
            return h
        # (gathered across ranks they come back on the host)
        rows = torch.cat([r.to(h.device) for _, r in self.first_rows[owner]], dim=1).double()
        return h + (2.0 * self.weight / rows.shape[1]) * (rows[left].T @ rows[1])

    def hessian(self, name: str) -> torch.Tensor | None:
        """``H~ = H + 2 weight mean_B(q q^T)`` [in, in]: what the column sweep takes too."""
        return self._with_sink(name, 1)

    def cross_term(self, name: str) -> torch.Tensor | None:
        """``C = H + 2 weight mean_B(x q^T)`` [in, in] (``C[i, j] = sum x_i q_j``)."""
        return self._with_sink(name, 0)


__all__ = ["SinkCollector"]

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
quantized so far (``q(x_b)`` rounds what the quantized model gives the GEMM, as in plain GPTQ).

The target (``--gptq-sink-target``): ``layer`` keeps ``W x_b``, the float weight's output on
that same input, so each GEMM keeps its own rounding off the first token but carries on the
drift the layers before it left there. ``float`` aims at the float model's output ``W x^f_b``
instead (asymmetric GPTQ's target, Li et al., "GPTAQ", 2025, for the first rows alone): each
GEMM also pulls the first token back toward the float model's trajectory, which every later
token attends to. The float model's first-token inputs are cheap to have: a first token
attends to itself alone, so its states are those of a one-token sequence, and
``FirstTokenStream`` carries the calibration sequences' first tokens through each float block
(one forward of ``sequences x 1`` tokens per block) before the block's GEMMs are quantized.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
from torch import nn

from ...model.block_inputs import ActivationStore, capture_block_inputs, run_block, to_device
from ...model.forward import run_batch
from ...model.gemm32 import float32_gemms
from ...observe.hessian import HessianCollector
from .asym import damped_cholesky
from .sweep import factor_dtype


def first_positions(batch):
    """A token batch cut to its first position (``[:, :1]`` of every tensor of two or more
    dimensions: ids, attention mask, positions)."""
    return {k: v[:, :1] if torch.is_tensor(v) and v.dim() >= 2 else v
            for k, v in batch.items()}


class FirstTokenStream:
    """The float model's first-token inputs of every GEMM, block by block: the calibration
    batches' first positions run up to block 0 once (``capture_block_inputs``: the model
    builds the masks and rotary tables of a one-token sequence itself), then through each
    block while it is still float (``through``, by ``run_block`` as the calibration batches
    are carried). A first token attends to itself alone, so these are exactly its states in
    the full-length forward. ``device``: where the blocks run, when the embeddings run
    elsewhere (the one-block GPU path)."""

    def __init__(self, model: nn.Module, first_block: nn.Module, batches: list,
                 device: torch.device | str | None = None):
        # sequences x hidden per batch: never spilled
        self.store = ActivationStore(1 << 62, home=device, compute=device)
        probes = [None if b is None else first_positions(b) for b in batches]
        kwargs = capture_block_inputs(model, first_block, probes, self.store)
        self.kwargs = kwargs if device is None else to_device(kwargs, device)

    def through(self, block: nn.Module, modules: dict[str, nn.Module]
                ) -> dict[str, dict[int, torch.Tensor]]:
        """Run the (still float) ``block`` on the first tokens: returns name -> batch index ->
        the first-token input rows of ``modules`` ([sequences, in], float32), and keeps the
        block's outputs as the next block's inputs."""
        ran = [j for j, kw in enumerate(self.kwargs) if kw is not None]
        nxt = self.store.like()
        with _first_inputs(modules) as seen:
            run_block(block, self.store, self.kwargs, nxt)
        rows = [self.store.get(j).shape[0] for j in ran]  # a batch may run in pieces
        self.store.close()
        self.store = nxt
        # a module called more than once a forward has no one first-token input: left out
        # (``SinkCollector`` keeps its own target there)
        return {name: dict(zip(ran, torch.cat(got).split(rows))) for name, got in seen.items()
                if sum(g.shape[0] for g in got) == sum(rows)}

    def close(self) -> None:
        self.store.close()


def first_token_inputs(unit: nn.Module, modules: dict[str, nn.Module], batches: list
                       ) -> dict[str, dict[int, torch.Tensor]]:
    """``FirstTokenStream.through`` for a unit run whole on token batches (a model
    without repeated blocks): its first-token inputs, from one forward of the first
    positions before any of its GEMMs is quantized."""
    ran = [j for j, b in enumerate(batches) if b is not None]
    with _first_inputs(modules) as seen, torch.inference_mode(), float32_gemms(model=unit):
        for j in ran:
            run_batch(unit, first_positions(batches[j]), logits=False)
    return {name: dict(zip(ran, got)) for name, got in seen.items() if len(got) == len(ran)}


@contextmanager
def _first_inputs(modules: dict[str, nn.Module]):
    """name -> the first-position input rows (``x[:, 0]``, float32) each of ``modules`` got,
    one entry per call, while the context is open."""
    seen: dict[str, list[torch.Tensor]] = {}

    def recorder(name):
        def hook(_module, args):
            if args and torch.is_tensor(args[0]) and args[0].dim() >= 3:
                seen.setdefault(name, []).append(args[0][:, 0].detach().float())
        return hook

    handles = [m.register_forward_pre_hook(recorder(name)) for name, m in modules.items()]
    try:
        yield seen
    finally:
        for h in handles:
            h.remove()


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
                 on_device: bool = False, dtype: torch.dtype = torch.float64,
                 anchors: dict[str, dict[int, torch.Tensor]] | None = None):
        super().__init__(modules, on_device=on_device, dtype=dtype)
        self.quantizers, self.weight = quantizers, weight
        # ``--gptq-sink-target float``: owner -> batch index -> the float model's first-token
        # inputs (``FirstTokenStream``), which replace ``x`` in the kept rows; ``at`` says
        # which batch the next forward runs
        self.anchors = anchors
        self._batch, self._taken = 0, {}
        # owner -> [(call index, [2, rows, features]: the inputs x and their rounding q)]
        self.first_rows: dict[str, list[tuple[int, torch.Tensor]]] = {}
        self._tilde: dict[str, torch.Tensor | None] = {}  # owner -> H~, once asked for
        self._solved: dict[tuple, torch.Tensor] = {}  # (owner, damp, dtype, device) -> [n, in]

    def at(self, batch: int) -> None:
        """The next forward runs calibration batch ``batch`` (its first rows' anchors)."""
        self._batch, self._taken = batch, {}

    def _accumulate(self, name: str, owner: str, x: torch.Tensor) -> None:
        super()._accumulate(name, owner, x)
        if x.dim() < 3:  # no sequence axis: no first token to single out
            return
        first = x.detach()[:, :1].float()
        q = self.quantizers.get(owner)
        qf = (q(first) if q is not None else first).reshape(-1, x.shape[-1]).float()
        aim = first.reshape(-1, x.shape[-1])
        floats = None if self.anchors is None else self.anchors.get(owner, {}).get(self._batch)
        if floats is not None:  # the float model's, for the same sequences (a GEMM the
            # one-token forward did not reach keeps its own target)
            start = self._taken.get(owner, 0)
            self._taken[owner] = start + aim.shape[0]
            aim = floats[start:start + aim.shape[0]].to(aim.device)
        rows = torch.stack([aim, qf])
        rows = rows if self.on_device else rows.cpu()
        kept = self.first_rows.setdefault(owner, [])
        kept.append((len(kept), rows))

    def _rows(self, owner: str, device) -> torch.Tensor:
        """The kept first rows of ``owner``, ``[2, n, features]`` float64 (0: x, 1: q)."""
        # (gathered across ranks they come back on the host)
        return torch.cat([r.to(device) for _, r in self.first_rows[owner]], dim=1).double()

    def _sink_update(self, owner: str, h: torch.Tensor, left: int) -> torch.Tensor:
        """``h += 2 weight mean_B(r q^T)`` in place, ``r`` the kept rows ``left`` (0: x, 1: q)
        minus, for ``left`` 0, ``q`` (``C - H~``: see ``cross_term``)."""
        rows = self._rows(owner, h.device).to(h.dtype)
        r = rows[0] - rows[1] if left == 0 else rows[1]
        return h.addmm_(r.T, rows[1], alpha=2.0 * self.weight / rows.shape[1])

    def hessian(self, name: str) -> torch.Tensor | None:
        """``H~ = H + 2 weight mean_B(q q^T)`` [in, in]: what the column sweep takes too.
        Computed once per input (q/k/v share it) and kept while the collector lives; callers
        do not modify it (the sweep copies what it changes). Built in place of the plain sum,
        which is dropped: one ``in x in`` float64 matrix per input instead of two (for a
        14,336-input ``down_proj``, 1.6 GB less while the group is quantized)."""
        owner = self.alias.get(name, name)
        if owner not in self._tilde:
            h = self.sums.pop(owner, None)
            if h is not None:  # float32 sums stay float32 (``factor_dtype``)
                h = h.to(factor_dtype(h))
                with torch.inference_mode():  # the sums were made under it: in place needs it
                    h.mul_(2.0).div_(max(self.rows[owner], 1))  # as ``_scaled``, bit for bit
                    if self.first_rows.get(owner):
                        self._sink_update(owner, h, 1)
            self._tilde[owner] = h
        return self._tilde[owner]

    def cross_term(self, name: str) -> torch.Tensor | None:
        """``C = H + 2 weight mean_B(x q^T)`` [in, in] (``C[i, j] = sum x_i q_j``), as
        ``H~ + 2 weight mean_B((x - q) q^T)`` (the plain sum is gone once ``H~`` is built)."""
        owner = self.alias.get(name, name)
        h = self.hessian(name)
        if h is None or not self.first_rows.get(owner):
            return h
        with torch.inference_mode():
            return self._sink_update(owner, h.clone(), 0)

    @property
    def nbytes(self) -> int:
        """Bytes of the Hessians held in memory (the sums, or ``H~`` once built)."""
        return super().nbytes + sum(h.numel() * h.element_size()
                                    for h in self._tilde.values() if h is not None)

    def aim(self, name: str, w0: torch.Tensor, damp: float) -> torch.Tensor:
        """``W*`` of ``name`` ([out, in], in the Hessian's dtype): ``asymmetric_target(w0,
        hessian(name), cross_term(name), damp)``, computed from the kept rows instead of
        ``C``.

        ``C - H~ = (2 weight / n) (X_B - Q_B)^T Q_B`` has the rank of the n first rows, so
        ``W0 (C - H~) A^-1 = (2 weight / n) (W0 R^T) (A^-1 Q_B^T)^T`` with ``R = X_B - Q_B``
        and ``A`` the dampened ``H~``: one Cholesky and a solve for n right-hand sides, where
        the dense form builds ``C``, ``C - H~`` and an ``in x in`` solve. Why: those
        ``in x in`` float64 temporaries, a few per GEMM, made the sink's share of a SmolLM2
        quantize larger than the column sweeps' (docs/results/speed.md, "Sequential GPTQ's
        speed")."""
        owner = self.alias.get(name, name)
        H = self.hessian(name)
        if H is None or not self.first_rows.get(owner):
            return w0.to(factor_dtype(w0) if H is None else H.dtype)
        # where H is (the host, for one too wide for the GPU: ``factored_on_host``), in its
        # dtype (float64, or float32 sums: ``hessian``); W* back on the weight's device
        dev, dt = H.device, H.dtype
        w = w0.to(dev, dt)
        rows = self._rows(owner, dev).to(dt)
        dead = torch.diagonal(H) == 0  # inputs always zero: W0's column is kept there
        Q = rows[1].masked_fill(dead.unsqueeze(0), 0.0)  # [n, in]
        low = (w @ (rows[0] - rows[1]).T).mul_(2.0 * self.weight / rows.shape[1])  # [out, n]
        key = (owner, damp, dt, dev)
        if key not in self._solved:  # A^-1 Q_B^T: the same for every GEMM of the input
            self._solved[key] = torch.cholesky_solve(Q.T.contiguous(),
                                                     damped_cholesky(H, damp, dt)).T
        return torch.addmm(w, low, self._solved[key]).to(w0.device)


__all__ = ["FirstTokenStream", "SinkCollector", "first_positions", "first_token_inputs"]

"""Sequential GPTQ's partial forwards: replay what the previous one already computed.

``fp8ptq.algorithms.gptq.sequential`` gathers each GEMM group's Hessian with one forward through
the block per batch, stopped at the group's input, after quantizing the group before it. In a Llama
block that is four forwards: to q/k/v (a norm), to ``o_proj`` (q/k/v, rotary, attention), to
gate/up (all that again plus ``o_proj``) and to ``down_proj`` (all that plus gate/up); the
later ones recompute the attention that did not change. What the previous forward finished
before it reached the group it stopped at cannot have changed since: only that group was
quantized in between, and a module that completed before any member of the group was
entered neither contains the group nor reads its outputs (a forward runs in order). So
``PartialForwards`` records the outputs of every submodule that completes in one forward,
keeps those that completed before the stop group was entered, and in the next forward of the
same batch makes the outermost of them return the recorded output instead of running (the
q/k/v projections in the gate/up forward, the whole attention in the down forward).

Bit for bit the same Hessians and codes: a replayed module returns the very values it computed
on the same batch with the same weights (``tests/test_gptq_sequential.py``). What is kept:
- modules called once per forward that contain a GEMM (a norm's output costs memory and saves
  next to nothing) and are not a module's sole child (a ``QuantGemm``'s inner ``Linear``: the
  wrapper's output is the one replayed);
- outputs that are a tensor or a tuple of tensors / None, copied on record, so that in-place
  updates downstream cannot touch the record; a record is replayed once (it is dropped as it
  is handed out), so the replay hands out the record itself and copies only if the module is
  called again in the same forward (which recording rules out: only modules called once are
  kept);
- in a unit's last group, only when a forward of the whole unit follows (a block's outputs
  for the next block: ``fp8ptq.model.block_inputs.run_block`` replays them and recomputes only
  ``down_proj`` and what follows it); otherwise nothing;
- at most ``budget`` bytes (what the sequential activation budget leaves beside the block
  inputs held in memory): past it a batch recomputes, as before.
Not used with asymmetric GPTQ's float stream.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
from torch import nn

from ...model.forward import clone_output, output_nbytes
from ...model.gemm import is_gemm


def _copy(out):
    """A copy of a module output that can be recorded (a tensor, or a tuple of tensors /
    None), or None when it cannot."""
    if torch.is_tensor(out) or (isinstance(out, tuple)
                                and all(o is None or torch.is_tensor(o) for o in out)):
        return clone_output(out)
    return None


class PartialForwards:
    """Records and replays submodule outputs of ``unit`` between consecutive partial forwards
    of the same batches (see the module docstring). ``run(j, stop_group, fn)`` runs ``fn``
    (one forward of batch ``j`` that ends on entering a member of ``stop_group``); ``clear()``
    when the unit changed without a recording forward in between (a group quantized without
    a Hessian)."""

    def __init__(self, unit: nn.Module, budget: int):
        self.unit, self.budget = unit, budget
        self.names = {m: n for n, m in unit.named_modules() if n}
        # only outputs that took a GEMM to make are worth their memory (a norm's is not), and
        # not the sole child of a module (a QuantGemm's inner Linear): its parent's output is
        # the one that would be replayed
        costly = {n for m, n in self.names.items() if any(is_gemm(x) for x in m.modules())}
        sole = {n for m, n in self.names.items() if n.rpartition(".")[0] and
                len(list(unit.get_submodule(n.rpartition(".")[0]).children())) == 1}
        self.wanted = costly - sole
        self.kept: dict[int, dict[str, object]] = {}  # batch -> {module name: output}
        self.replayed = 0  # module outputs replayed (for tests and the report)

    def clear(self) -> None:
        self.kept.clear()

    def _bytes(self) -> int:
        return sum(output_nbytes(o) for outs in self.kept.values() for o in outs.values())

    def run(self, j: int, stop_group: list[nn.Module], fn, record: bool = True) -> None:
        """``fn`` with the outputs recorded for batch ``j`` replayed; ``record``: keep what
        this forward finishes for the next (False for a unit's last group: nothing follows)."""
        replay = self.kept.pop(j, {})
        done: dict[str, object] = {}  # name -> output copy, of modules done before the entry
        calls: dict[str, int] = {}
        entered: list[bool] = []

        def on_done(module, _args, output):
            name = self.names.get(module)
            if name is None:
                return
            calls[name] = calls.get(name, 0) + 1
            # after the stop group was entered nothing is kept; nor what is not worth keeping
            if record and not entered and name in self.wanted:
                done[name] = _copy(output)

        def on_enter(_module, _args):
            if not entered:
                entered.append(True)

        handles = [nn.modules.module.register_module_forward_hook(on_done)]
        handles += [m.register_forward_pre_hook(on_enter, prepend=True) for m in stop_group]
        with self._replaying(replay):
            try:
                fn()
            finally:
                for h in handles:
                    h.remove()
        self._keep(j, done, calls)

    @contextmanager
    def replaying(self, j: int):
        """Batch ``j``'s records replayed (and dropped) during a forward run by someone else:
        the whole-unit forward after the unit's last group, whose records (modules done
        before that group) its quantization did not change."""
        with self._replaying(self.kept.pop(j, {})):
            yield

    @contextmanager
    def _replaying(self, replay: dict[str, object]):
        saved = []
        for name, out in replay.items():
            m = self.unit.get_submodule(name)
            saved.append((m, m.__dict__.get("forward")))
            m.forward = _replayer(out)
            self.replayed += 1
        try:
            yield
        finally:
            for m, old in saved:
                if old is None:
                    m.__dict__.pop("forward", None)
                else:
                    m.forward = old

    def _keep(self, j: int, done: dict, calls: dict) -> None:
        """The outermost recordable modules called once, within the budget."""
        ok = {n: out for n, out in done.items() if out is not None and calls[n] == 1}
        outer = {n: out for n, out in ok.items()
                 if not any(n.startswith(p + ".") for p in ok if p != n)}
        size = sum(output_nbytes(o) for o in outer.values())
        if outer and self._bytes() + size <= self.budget:
            self.kept[j] = outer


def _replayer(out):
    """A ``forward`` that returns ``out``: the record itself the first time (nothing else holds
    it), a copy on any later call."""
    handed = False

    def forward(*_args, **_kwargs):
        nonlocal handed
        if handed:
            return _copy(out)
        handed = True
        return out
    return forward


__all__ = ["PartialForwards"]

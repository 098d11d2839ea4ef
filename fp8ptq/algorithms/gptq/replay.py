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

One more kind of record: a module whose output is its last GEMM's (a Llama attention returns
``o_proj``'s output, an MLP ``down_proj``'s; ``tails``, learnt in the forward that finds the
groups, from the very tensor objects returned) is replayed as that GEMM applied to the input it
was stopped on in the previous forward, when that GEMM was the group just quantized: the gate/up
forward then runs ``o_proj`` on the recorded attention output instead of the q/k/v replay,
rotary and attention again, and the forward that makes the next block's inputs runs
``down_proj`` on its recorded input. The same bits: everything inside the module before that
GEMM ran with the weights it had when recorded.
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
        # module name -> (attribute of the GEMM child whose output it returns, the output's
        # form: 0 that tensor, n a tuple of n with the rest None); see ``probe``
        self.tails: dict[str, tuple[str, int]] = {}

    def clear(self) -> None:
        self.kept.clear()

    def _bytes(self) -> int:
        return sum(output_nbytes(o.x if isinstance(o, _Tail) else o)
                   for outs in self.kept.values() for o in outs.values())

    @contextmanager
    def probe(self):
        """Within: one whole forward of the unit (the one that finds the groups) teaches
        ``tails``: the modules called once whose output (or a tuple's first element, the
        others None) is the very tensor a GEMM-holding direct child called once returned."""
        names = {m: n for n, m in self.unit.named_modules() if n}
        returned: dict[int, tuple[torch.Tensor, str]] = {}  # id -> (tensor, last returner)
        calls: dict[str, int] = {}
        found: dict[str, tuple[str, int]] = {}

        def on_done(module, _args, output):
            name = names.get(module)
            if name is None:
                return
            calls[name] = calls.get(name, 0) + 1
            arity, first = _tail_form(output)
            if first is None:
                return
            child = returned.get(id(first))
            if child is not None and child[0] is first and \
                    child[1].rpartition(".")[0] == name and \
                    _gemm_like(self.unit.get_submodule(child[1])):
                found[name] = (child[1].rpartition(".")[2], arity)
            returned[id(first)] = (first, name)

        handle = nn.modules.module.register_module_forward_hook(on_done)
        try:
            yield
        finally:
            handle.remove()
        self.tails = {n: t for n, t in found.items()
                      if calls.get(n) == 1 and calls.get(f"{n}.{t[0]}") == 1}

    def _tail_of(self, module: nn.Module) -> str | None:
        """The module (name) whose output is ``module``'s, where ``module`` is its tail GEMM
        (``tails``; a ``QuantGemm``'s inner ``Linear`` stands for the wrapper), else None."""
        name = next((n for n, m in self.unit.named_modules() if m is module), None)
        while name:
            parent, _, attr = name.rpartition(".")
            if self.tails.get(parent, (None,))[0] == attr:
                return parent
            if not parent or len(list(self.unit.get_submodule(parent).children())) != 1:
                return None
            name = parent  # the sole child of a wrapper: the wrapper is the GEMM
        return None

    def run(self, j: int, stop_group: list[nn.Module], fn, record: bool = True) -> None:
        """``fn`` with the outputs recorded for batch ``j`` replayed; ``record``: keep what
        this forward finishes for the next (False for a unit's last group: nothing follows)."""
        replay = self.kept.pop(j, {})
        done: dict[str, object] = {}  # name -> output copy, of modules done before the entry
        calls: dict[str, int] = {}
        entered: list[bool] = []
        # a lone stop GEMM that is its parent's tail: its input, recorded on entry
        owner = self._tail_of(stop_group[0]) if record and len(stop_group) == 1 else None
        tail: list = []

        def on_done(module, _args, output):
            name = self.names.get(module)
            if name is None:
                return
            calls[name] = calls.get(name, 0) + 1
            # after the stop group was entered nothing is kept; nor what is not worth keeping
            if record and not entered and name in self.wanted:
                done[name] = _copy(output)

        def on_enter(_module, args):
            if not entered:
                entered.append(True)
                if owner is not None and args and torch.is_tensor(args[0]):
                    tail.append(args[0].clone())

        handles = [nn.modules.module.register_module_forward_hook(on_done)]
        handles += [m.register_forward_pre_hook(on_enter, prepend=True) for m in stop_group]
        with self._replaying(replay):
            try:
                fn()
            finally:
                for h in handles:
                    h.remove()
        if tail:
            # the owner runs as its tail GEMM next time: nothing inside it is needed
            done = {n: o for n, o in done.items() if not n.startswith(owner + ".")}
        self._keep(j, done, calls, (owner, _Tail(self.tails[owner], tail[0])) if tail else None)

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
            m.forward = _tail_replayer(m, out) if isinstance(out, _Tail) else _replayer(out)
            self.replayed += 1
        try:
            yield
        finally:
            for m, old in saved:
                if old is None:
                    m.__dict__.pop("forward", None)
                else:
                    m.forward = old

    def _keep(self, j: int, done: dict, calls: dict, tail=None) -> None:
        """The outermost recordable modules called once, and ``tail`` (name, ``_Tail``),
        within the budget."""
        ok = {n: out for n, out in done.items() if out is not None and calls[n] == 1}
        outer = {n: out for n, out in ok.items()
                 if not any(n.startswith(p + ".") for p in ok if p != n)}
        if tail is not None:
            outer[tail[0]] = tail[1]
        size = sum(output_nbytes(o.x if isinstance(o, _Tail) else o) for o in outer.values())
        if outer and self._bytes() + size <= self.budget:
            self.kept[j] = outer


def _gemm_like(module: nn.Module) -> bool:
    """A GEMM, or a wrapper whose sole child is one (a ``QuantGemm``)."""
    children = list(module.children())
    return is_gemm(module) or (len(children) == 1 and _gemm_like(children[0]))


class _Tail:
    """A tail record: the module's output is its child GEMM ``attr`` applied to ``x``, in the
    form ``arity`` (0: that tensor; n: a tuple of n, the rest None)."""

    __slots__ = ("attr", "arity", "x")

    def __init__(self, tail: tuple[str, int], x: torch.Tensor):
        (self.attr, self.arity), self.x = tail, x


def _tail_form(output) -> tuple[int, torch.Tensor | None]:
    """(form, the tensor a tail GEMM would have returned) of a module output: a tensor, or a
    tuple whose first element is a tensor and the rest None; else (0, None)."""
    if torch.is_tensor(output):
        return 0, output
    if isinstance(output, tuple) and output and torch.is_tensor(output[0]) \
            and all(o is None for o in output[1:]):
        return len(output), output[0]
    return 0, None


def _tail_replayer(module: nn.Module, rec: _Tail):
    """A ``forward`` that runs the module's tail GEMM (as it is now) on the recorded input."""
    def forward(*_args, **_kwargs):
        out = getattr(module, rec.attr)(rec.x)
        return out if rec.arity == 0 else (out, *([None] * (rec.arity - 1)))
    return forward


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

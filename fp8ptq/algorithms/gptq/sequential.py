"""Sequential GPTQ: each GEMM's Hessian from the inputs the already-quantized model gives it.

One-pass GPTQ (``HessianCollector`` in the calibration pass) takes every Hessian from the float
model, so each layer compensates its own rounding but not what the layers before it left in its
input. Frantar et al., "GPTQ: Accurate Post-Training Quantization for Generative Pre-trained
Transformers", 2022, section 4 (and their reference code's ``--true-sequential``) quantize in
the order the model runs: a GEMM's inputs come from the model whose earlier GEMMs are already
quantized, so its error compensation also absorbs the error propagated from them (as
llm-compressor's sequential pipeline does, one decoder layer at a time).

fp8ptq goes one step finer than one layer at a time: inside each block the GEMMs are taken in
groups, in the order the block runs them (q/k/v, then o, then gate/up, then down: GEMMs fed the
very same tensor are one group, with one Hessian), and each group's Hessian is gathered with
every earlier group already quantized, activations included (a ``QuantGemm`` simulates its input
quantization). Cost and memory stay those of one block: the calibration batches run once up to
block 0 (``fp8ptq.model.block_inputs``: in memory up to a budget, spilled to files beyond),
then per block one partial forward per group (stopped at the group's input) and one forward through
the quantized block to make the next block's inputs (plus one forward of a single sequence
that finds the groups). Each forward replays what the one before it finished and the
quantization in between did not change (``fp8ptq.algorithms.gptq.replay``), and runs a module
whose output is its last GEMM's as that GEMM on the input the forward before stopped on: a Llama
block's attention core runs once per batch, and the forward that makes the next block's inputs
runs only ``down_proj`` and what follows it. Only one group's Hessians are held at once.

Models without repeated blocks are one unit (the whole model, one forward per group). GEMMs
outside the blocks (a quantized ``lm_head``) keep the one-pass Hessian of the float model.
Fused MoE experts given as ``experts`` are one step each where the block runs them, each expert
with its own Hessians (``fp8ptq.algorithms.gptq.experts``).
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from contextlib import nullcontext

import torch
from torch import nn

from ...config.plan import hessian_diagonal_only
from ...model.block_inputs import ActivationStore, BlockBatch, capture_block_inputs, run_block
from ...model.blocks import block_prefix, find_blocks
from ...model.forward import micro_batches, run_batch
from ...model.gemm import weight_2d
from ...model.lean import lean_forwards
from ...observe import distributed
from ...observe.hessian import HessianCollector
from .aim import Aim
from .asym import AsymmetricCollector, input_quantizer
from .experts import ExpertSteps, QuantizeExperts
from .replay import PartialForwards
from .sink import FirstTokenStream, SinkCollector, first_token_inputs
from .sweep import factored_on_host, shared_factors

# (plan entry, Hessian or None, the weight GPTQ aims at: None = the module's own)
Quantize = Callable[[object, "torch.Tensor | None", "torch.Tensor | None"], None]


class _Stop(Exception):
    pass


def quantize_in_order(model: nn.Module, targets: list, gptq: set[str], batches: list,
                      quantize: Quantize, *, activation_budget: int = 1 << 30,
                      spill_dir=None, aim: Aim | None = None,
                      hessian_dtype: torch.dtype = torch.float64, experts: list = (),
                      quantize_experts: QuantizeExperts | None = None,
                      first_tokens: dict | None = None) -> dict:
    """Quantize the ``targets`` (plan entries) inside the model's blocks in run order, calling
    ``quantize(target, hessian, aim)`` for each; ``gptq``: names of the targets that want a
    Hessian. ``aim``: what GPTQ aims at (``Aim``: asymmetric or sink-aware), handed to
    ``quantize`` as its ``W*``; None: plain (``aim`` None); ``hessian_dtype``: what the
    Hessian sums are accumulated in (``gptq_hessian_dtype``). Those outside the blocks
    (``outside_blocks``) are left to the caller. Returns the facts for the report
    (``blocks``, ``groups``, ``forwards``, ``replayed_outputs`` (module outputs
    ``fp8ptq.algorithms.gptq.replay`` replayed instead of recomputing),
    ``max_hessian_bytes``,
    ``outside``: the names left to the caller; ``aim``: its kind and sink weight, or None;
    ``aim_correction``: the largest and mean
    ``||W* - W0|| / ||W0||``). ``experts``: fused-experts plan entries swept by
    ``quantize_experts(entry, feed)`` where their block runs them. ``first_tokens``: for a
    unit streamed on its own (``--sequential``), its GEMMs' float first-token inputs
    (``FirstTokenStream.through``), which sink-aware GPTQ aimed at the float model needs;
    a whole model makes its own."""
    found = find_blocks(model)
    steps = ExpertSteps(quantize_experts) if experts else None
    outside = outside_blocks(model, targets)
    facts = {"blocks": 0, "groups": 0, "forwards": 0, "replayed_outputs": 0,
             "max_hessian_bytes": 0, "outside": []}
    facts["aim"] = None if aim is None else {"kind": aim.kind, "weight": aim.weight,
                                             **({"target": aim.target} if aim.sink else {})}
    if aim is not None:
        facts["aim_correction"] = []
    asym = aim is not None and aim.asym
    anchored = aim is not None and aim.anchored
    if found is None:
        facts["blocks"] = 1
        floats = _Floats(model, batches, aim, hessian_dtype)
        if anchored and first_tokens is not None:
            floats.anchors = first_tokens
        elif anchored:  # a block's recorded inputs are past the embeddings: no tokens there
            if any(isinstance(b, BlockBatch) for b in batches):
                raise ValueError("a streamed block's float first-token inputs are its "
                                 "caller's to give (first_tokens)")
            floats.anchors = first_token_inputs(model, _gemms(targets), batches)
        partial = _quantize_unit(model, [*targets, *experts], gptq, batches, quantize, facts,
                                 floats, activation_budget, experts=steps)
        _count_replayed(facts, partial)
        _summarise(facts)
        return facts
    list_name, blocks = found
    inside = {i: [t for t in [*targets, *experts]
                  if t.name.startswith(block_prefix(list_name, i))]
              for i in range(len(blocks))}
    facts["outside"] = outside
    store = ActivationStore(activation_budget, spill_dir)
    kwargs_list = capture_block_inputs(model, blocks[0], batches, store,
                                       distributed.share_indices(len(batches)))
    # sink-aware GPTQ aimed at the float model: its first tokens, carried block by block
    firsts = FirstTokenStream(model, blocks[0], batches) if anchored else None
    # the float stream (asymmetric GPTQ): the float model's hidden states, block by block
    fstore = ActivationStore(activation_budget, spill_dir) if asym else store
    if asym:
        for j in range(len(kwargs_list)):
            if kwargs_list[j] is not None:
                fstore.put(j, store.get(j))
    try:
        for i, block in enumerate(blocks):
            prefix = block_prefix(list_name, i)
            local = [_Local(t, prefix) for t in inside[i]]
            block_batches, float_batches = ([None if kw is None else BlockBatch(s, j, kw)
                                             for j, kw in enumerate(kwargs_list)]
                                            for s in (store, fstore))
            floats = _Floats(block, float_batches, aim, hessian_dtype)
            if firsts is not None:  # before any of the block's GEMMs is quantized
                floats.anchors = firsts.through(block, _gemms(local))
            follows = i + 1 < len(blocks)
            partial = _quantize_unit(
                block, local, {t.name for t in local if t.target.name in gptq}, block_batches,
                lambda lt, h, aim: quantize(lt.target, h, aim), facts, floats,
                max(0, activation_budget - store.resident_bytes), follows=follows,
                experts=steps)
            facts["blocks"] += 1
            if follows:
                # the next block's inputs: what the last group's forward finished before that
                # group (the attention, gate/up in a Llama block) is replayed, not recomputed
                nxt = ActivationStore(activation_budget, spill_dir)
                run_block(block, store, kwargs_list, nxt, replay=partial)
                facts["forwards"] += 1
                store.close()
                store = nxt
                if floats.unit is not None:
                    fnxt = ActivationStore(activation_budget, spill_dir)
                    run_block(floats.unit, fstore, kwargs_list, fnxt)
                    facts["forwards"] += 1
                    fstore.close()
                    fstore = fnxt
            _count_replayed(facts, partial)
    finally:
        store.close()
        fstore.close()
        if firsts is not None:
            firsts.close()
    _summarise(facts)
    return facts


def _count_replayed(facts: dict, partial: PartialForwards | None) -> None:
    if partial is not None:
        facts["replayed_outputs"] += partial.replayed
        partial.clear()


class _Floats:
    """What one unit's GPTQ aims at (``aim``; None: plain) and, for asymmetric GPTQ, the float
    stream: a float copy of the unit taken before any of its GEMMs is quantized (``unit``,
    else None) and its batches."""

    def __init__(self, unit: nn.Module, batches: list, aim: Aim | None,
                 dtype: torch.dtype = torch.float64):
        self.unit = copy.deepcopy(unit) if aim is not None and aim.asym else None
        self.batches, self.aim = batches, aim
        self.dtype = dtype  # what the unit's Hessian sums are accumulated in
        # ``--gptq-sink-target float``: name -> batch index -> the float model's first-token
        # inputs (``fp8ptq.algorithms.gptq.sink.FirstTokenStream``)
        self.anchors: dict | None = None

    @property
    def sink(self) -> float:
        return 0.0 if self.aim is None else self.aim.sink


def _summarise(facts: dict) -> None:
    sizes = facts.pop("aim_correction", None)
    if sizes:
        facts["aim_correction"] = {"max": max(sizes), "mean": sum(sizes) / len(sizes)}


def outside_blocks(model: nn.Module, targets: list) -> list[str]:
    """Names of the targets outside the model's repeated blocks (none if it has no blocks):
    they keep the one-pass Hessian of the float model."""
    found = find_blocks(model)
    if found is None:
        return []
    list_name, blocks = found
    prefixes = tuple(block_prefix(list_name, i) for i in range(len(blocks)))
    return [t.name for t in targets if not t.name.startswith(prefixes)]


class _Local:
    """A plan entry seen from inside its block: its name relative to the block."""

    def __init__(self, target, prefix: str):
        self.target, self.name = target, target.name[len(prefix):]
        self.module = target.module


def _quantize_unit(unit: nn.Module, targets: list, gptq: set[str], batches: list,
                   quantize: Quantize, facts: dict, floats: _Floats,
                   reuse_budget: int = 1 << 30, follows: bool = False,
                   experts: ExpertSteps | None = None) -> PartialForwards | None:
    """The targets of one unit (a block, or a model without blocks) group by group in run
    order; each GPTQ group's Hessian from a forward through the unit as quantized so far
    (and, asymmetric, the float copy's forward on the float stream). ``follows``: a forward
    of the whole unit comes next (a block's outputs for the next block), which can replay
    what the last group's forward recorded. Returns the replay records (None: none kept)."""
    if not targets:
        return None
    # what one group's forward computed before reaching that group, replayed in the next
    # group's (``fp8ptq.algorithms.gptq.replay``); not beside asymmetric GPTQ's float stream
    partial = None if floats.unit is not None else PartialForwards(unit, reuse_budget)
    groups = _groups_in_run_order(unit, targets, batches,
                                  partial.probe if partial is not None else nullcontext)
    for g, group in enumerate(groups):
        if experts is not None and _is_experts(group[0]):  # alone in its group
            experts.run(unit, _entry(group[0]), batches, partial, facts,
                        record=follows or g + 1 < len(groups))
            continue
        wanted = [t for t in group if t.name in gptq]
        hessians = None
        if wanted and any(b is not None for b in batches):
            # the unit's last group records only for the forward that follows the unit
            hessians = _group_hessians(unit, wanted, batches, floats, partial,
                                       [t.module for t in group],
                                       record=follows or g + 1 < len(groups))
            facts["forwards"] += 1 + (floats.unit is not None)
            facts["max_hessian_bytes"] = max(facts["max_hessian_bytes"], hessians.nbytes)
        elif partial is not None:
            partial.clear()  # this group changes without a forward that records past it
        facts["groups"] += 1
        with shared_factors():  # the group's GEMMs share one input, so one H~ and one factor
            _quantize_group(group, hessians, gptq, floats, quantize, facts)
    return partial


def _quantize_group(group: list, hessians, gptq: set[str], floats, quantize: Callable,
                    facts: dict) -> None:
    """Each target of one group, in turn: its Hessian, sink-aware ``W*`` and sweep."""
    for t in group:
        h = hessians.hessian(t.name) if hessians and t.name in gptq else None
        aim = None
        if h is not None and floats.aim is not None:
            w0 = weight_2d(t.module).detach()
            # float64 (float32 for sink-aware GPTQ on a GPU: its Hessians are float32)
            w0 = w0.float() if w0.is_cuda and floats.aim.sink else w0.double()
            # each collector computes its own ``W*`` (the sink's from its kept rows)
            aim = hessians.aim(t.name, w0, floats.aim.damp)
            facts["aim_correction"].append(
                float((aim - w0).norm() / max(float(w0.norm()), 1e-30)))
            del w0  # a float64 copy of the weight: not kept through the sweep
        quantize(t, h, aim)


def _groups_in_run_order(unit: nn.Module, targets: list, batches: list,
                         watch=nullcontext) -> list[list]:
    """Targets in the order one forward reaches them, those fed the same input tensor in one
    group; targets that forward never reaches come last, one each.

    The order is the block's code, not its data, so the forward runs the first sequence of
    the first batch alone (1/8 of a default batch: this forward ran once per block over a
    whole batch, ~6% of a block's forwards at 16 batches, half at 2). Only where that
    sequence leaves a target unreached (a routed expert) does the whole batch run, as
    before. ``watch``: a context the forward runs in (``PartialForwards.probe``)."""
    example = next((b for b in batches if b is not None), None)
    if example is None:
        return [[t] for t in targets]
    first = micro_batches(example, tokens=1)[0]
    groups, seen = _run_order(unit, targets, first, watch)
    if len(seen) < len(targets) and first is not example:
        groups, seen = _run_order(unit, targets, example, watch)
    return groups + [[t] for t in targets if t.name not in seen]


def _run_order(unit: nn.Module, targets: list, example,
               watch=nullcontext) -> tuple[list[list], set[str]]:
    """(groups in call order, names reached) of one forward of ``example``."""
    order: list[tuple[object, list]] = []  # (input tensor, targets) in call order
    seen: set[str] = set()

    def hook_for(t):
        def hook(_module, args):
            if t.name in seen or not args or not torch.is_tensor(args[0]):
                return
            seen.add(t.name)
            if order and order[-1][0] is args[0] and not _is_experts(t) \
                    and not _is_experts(order[-1][1][0]):
                order[-1][1].append(t)
            else:
                order.append((args[0], [t]))
        return hook

    handles = [t.module.register_forward_pre_hook(hook_for(t)) for t in targets]
    try:
        with torch.inference_mode(), watch():
            run_batch(unit, example, logits=False)
    finally:
        for h in handles:
            h.remove()
    return [ts for _, ts in order], seen


def _group_hessians(unit: nn.Module, group: list, batches: list, floats: _Floats,
                    partial: PartialForwards | None = None,
                    members: list | None = None, record: bool = True) -> HessianCollector:
    """The group's Hessians from every batch, each forward stopped on entering the group's
    first member (its input is every member's: nothing after it is needed); reduced across
    ranks. With a
    float stream each batch first runs the float copy to the same point, for the cross
    terms (``AsymmetricCollector``)."""
    # one group's sums at a time: they stay on the device its inputs are on (``on_device``)
    modules = {t.name: t.module for t in group}
    quantizers = {t.name: input_quantizer(_entry(t)) for t in group}
    if floats.sink:
        collector = SinkCollector(modules, quantizers, floats.sink, on_device=True,
                                  dtype=floats.dtype, anchors=floats.anchors)
    elif floats.unit is None:
        collector = HessianCollector(modules, on_device=True, dtype=floats.dtype,
                                     diagonal=hessian_diagonal_only([_entry(t) for t in group]))
    else:
        collector = AsymmetricCollector(modules, quantizers, on_device=True, dtype=floats.dtype)
    error = None
    handles = []
    # the partial forwards run the same fewer-temporaries code as the statistics pass and
    # ``run_block`` (bit for bit transformers' outputs): under transformers' own rotary and
    # RMSNorm they were a visible share of a sequential GPTQ quantize of SmolLM2 in a profile
    with collector.observing(), torch.inference_mode(), lean_forwards(unit), \
            lean_forwards(floats.unit) if floats.unit is not None else nullcontext():
        # The members share one input tensor (``_groups_in_run_order``), so the first one's
        # pre-hook sees it for all of them and the forward stops there: stopped at the last
        # member, it had run the others' GEMMs first for nothing (q and k before v, gate
        # before up: 3 of a Llama block's 7 per batch). Registered after the collector's
        # hooks, so it runs after them.
        observed = [t for t in group if t.name in collector.modules]
        first = observed[0] if observed else group[-1]
        collector.share([t.name for t in observed])
        stop = first.module.register_forward_pre_hook(_raise_stop)
        if floats.unit is not None:
            handles = collector.float_hooks(floats.unit, {t.name: t.name for t in group})
            handles.append(floats.unit.get_submodule(first.name)
                           .register_forward_pre_hook(_raise_stop))
        try:
            for j, batch in distributed.shard(batches):
                if batch is None:
                    continue
                if floats.anchors is not None:
                    collector.at(j)
                if floats.unit is not None:
                    _run_to_stop(floats.unit, floats.batches[j])
                if partial is None:
                    _run_to_stop(unit, batch)
                else:  # ``members``: the whole group, quantized before the next forward
                    partial.run(j, members or [t.module for t in group],
                                lambda b=batch: _run_to_stop(unit, b), record)
        except Exception as e:  # noqa: BLE001 - re-raised by agree, on every rank
            error = e
        finally:
            stop.remove()
            for h in handles:
                h.remove()
    distributed.agree(error)
    distributed.reduce_sums(collector.sums, collector.rows)
    if floats.unit is not None:
        distributed.reduce_sums(collector.cross, {})
    if floats.sink:
        collector.first_rows = distributed.gather_samples(collector.first_rows)
    for owner, h in list(collector.sums.items()):  # too wide for the GPU: factored on the host
        if factored_on_host(h.shape[0], h.device):
            collector.sums[owner] = h.cpu()
            del h
    return collector


def _gemms(targets: list) -> dict[str, nn.Module]:
    """Name -> module of the targets that are GEMMs (not fused experts)."""
    return {t.name: t.module for t in targets if not _is_experts(t)}


def _run_to_stop(unit: nn.Module, batch) -> None:
    try:
        run_batch(unit, batch, logits=False)
    except _Stop:
        pass


def _entry(t):
    """The plan entry of ``t`` (a ``_Local`` inside a block, or the entry itself)."""
    return getattr(t, "target", t)


def _raise_stop(_module, _args):
    raise _Stop


def _is_experts(t) -> bool:
    """A fused-experts plan entry (``ModulePlan.experts`` set)."""
    return getattr(_entry(t), "experts", None) is not None


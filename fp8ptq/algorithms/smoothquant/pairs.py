"""SmoothQuant between two GEMMs: ``1/s`` folded into a producer GEMM's output rows, ``s`` into
the consumer GEMM's input columns (``--smoothquant-into gemms|all``).

The norm groups of ``fp8ptq.algorithms.smoothquant.groups`` leave out the GEMMs whose input is no
module's
output: in a Llama-family block those are ``o_proj`` (input: attention probabilities times V)
and ``down_proj`` (input: ``act(gate) * up``) - and ``down_proj``'s input is where small
decoders carry their massive activations (SmolLM2-135M: one channel reaches ~2,400 at the first
position, everything else <= 56). Both inputs are *linear per channel* in one GEMM's output:

- ``down_proj``'s input channel j is ``act(gate_j) * up_j``: dividing ``up_proj``'s output row
  j (weight row and bias) by ``s_j`` divides that channel by ``s_j`` exactly;
- ``o_proj``'s input channel (head h, dim d) is a convex mixture over positions of ``v_proj``'s
  output channel (kv head of h, d): dividing V's row by ``s`` divides it exactly. With grouped
  query attention one V row feeds several q heads, so ``s`` is chosen per V row (activation and
  weight maxima taken over every o_proj channel that row feeds) and repeated for each head.

Pairs are found, not listed by module name: for each quantized GEMM whose input no module
produces (the "unmatched" consumers of the norm tracing), the GEMMs that ran since the previous
such consumer (at most ``MAX_CANDIDATES``) are candidate producers if their output width equals
the consumer's input width (channel j -> j) or divides it by whole heads (the config's
``head_dim``; channel (h, d) -> (h // repeats, d)). Each candidate is then *checked* as the norm
groups are: the producer's output divided and the consumer's input multiplied by random powers
of two (exact in any float dtype) must leave the model's output unchanged on a short prefix of
the example batch. ``gate_proj -> down_proj`` (through SiLU) and ``q/k_proj -> o_proj`` (through
the softmax) fail that check and are reported as skipped; only an exact pair is smoothed.

The factors follow SmoothQuant (Xiao et al., 2023): ``s = max|X|^alpha / max|W|^(1 - alpha)``,
``X`` the consumer's calibration input, ``W`` its weight columns. The producer's weight rows
are divided by ``s``, which per-output-channel weight scales absorb (rounding error unchanged);
with tensor or block weight scales the producer's rounding changes too.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch
from torch import nn

from ...model.gemm import find_gemms, weight_2d, weight_from_2d
from .groups import SMOOTHABLE, _close, _flat_tensors, _pow2_factors, _run

MAX_CANDIDATES = 8  # producers tried per consumer: the GEMMs run just before it
CHECK_TOKENS = 32  # the exactness checks run on this prefix of the example row


@dataclass
class Pair:
    producer: str
    consumer: str
    prod: nn.Module
    cons: nn.Module
    index: torch.Tensor  # consumer input channel c is producer output channel index[c]
    repeats: int  # consumer channels per producer channel (1: the identity map)

    @property
    def name(self) -> str:
        return f"{self.producer} -> {self.consumer}"


def discover_pairs(model, example, by_name, stats, consumers, report) -> list[Pair]:
    """Exact producer -> consumer GEMM pairs for the quantized GEMMs ``consumers`` (the ones
    no norm feeds); refused consumers go to ``report["skipped"]`` with the reason."""
    gemms = dict(find_gemms(model))
    order = _run_order(model, example, gemms)
    uses: dict[int, int] = {}
    for _, p in model.named_parameters(remove_duplicate=False):
        uses[id(p)] = uses.get(id(p), 0) + 1
    short = _prefix(example, CHECK_TOKENS)
    reference = _flat_tensors(_run(model, short))
    dtype = next((p.dtype for p in model.parameters()), torch.float32)
    head_dim = _head_dim(model)
    pairs, taken, boundary = [], set(), 0
    wanted = set(consumers)
    for pos, name in enumerate(order):
        if name not in wanted:
            continue
        earlier, boundary = order[boundary:pos][-MAX_CANDIDATES:], pos + 1
        cons = gemms[name]
        problem = _consumer_problem(name, cons, by_name, stats, uses)
        if problem is None:
            found = None
            for prod_name in reversed(earlier):
                cand = _candidate(prod_name, gemms[prod_name], name, cons, head_dim, uses)
                if cand is not None and prod_name not in taken and \
                        _exact(model, short, [cand], reference, dtype):
                    found = cand
                    break
            if found is None:
                problem = (f"no exact producer among the GEMMs run before it "
                           f"({', '.join(earlier) or 'none'})")
            else:
                pairs.append(found)
                taken.add(found.producer)
        if problem is not None:
            report["skipped"][name] = problem
    if pairs and not _exact(model, short, pairs, reference, dtype):  # jointly, to be sure
        for p in pairs:
            report["skipped"][p.consumer] = f"{p.name}: not exact together with the others"
        pairs = []
    return pairs


def reduce_to_producer(values: torch.Tensor, pair: Pair) -> torch.Tensor:
    """Per consumer channel -> per producer channel (max over the channels a row feeds)."""
    n = weight_2d(pair.prod).shape[0]
    out = torch.zeros(n, dtype=values.dtype)
    return out.scatter_reduce(0, pair.index, values.cpu(), "amax", include_self=False)


@torch.no_grad()
def fold_pair(pair: Pair, s_prod: torch.Tensor) -> str | None:
    """Producer rows (and bias) / s, consumer columns * s[index]; returns why not, if the
    result would not be finite in the weights' dtypes (nothing is changed then)."""
    wp = weight_2d(pair.prod).detach().float() / s_prod.to(pair.prod.weight.device)[:, None]
    new = {pair.prod.weight: weight_from_2d(pair.prod, wp).to(pair.prod.weight.dtype)}
    b = getattr(pair.prod, "bias", None)
    if b is not None:
        new[b] = (b.detach().float() / s_prod.to(b.device)).to(b.dtype)
    s_cons = s_prod[pair.index].to(pair.cons.weight.device)
    wc = weight_2d(pair.cons).detach().float() * s_cons
    new[pair.cons.weight] = weight_from_2d(pair.cons, wc).to(pair.cons.weight.dtype)
    if not all(bool(torch.isfinite(v).all()) for v in new.values()):
        return f"smoothed weights overflow {pair.cons.weight.dtype}; left unsmoothed"
    for p, v in new.items():
        p.copy_(v)
    return None


# --- discovery helpers -------------------------------------------------------------------------

def _run_order(model, example, gemms) -> list[str]:
    """GEMM names in the order they first run."""
    order, seen = [], set()

    def hook(name):
        def pre(_m, _args):
            if name not in seen:
                seen.add(name)
                order.append(name)
        return pre

    handles = [m.register_forward_pre_hook(hook(n)) for n, m in gemms.items()]
    try:
        _run(model, _prefix(example, CHECK_TOKENS))
    finally:
        for h in handles:
            h.remove()
    return order


def _prefix(example, n: int):
    """The first ``n`` positions of a token batch (the tensors shaped like ``input_ids``)."""
    if not isinstance(example, Mapping) or not torch.is_tensor(example.get("input_ids")):
        return example
    ids = example["input_ids"]
    if ids.dim() != 2 or ids.shape[1] <= n:
        return example
    return {k: v[:, :n] if torch.is_tensor(v) and v.shape[:2] == ids.shape else v
            for k, v in example.items()}


def _head_dim(model) -> int | None:
    cfg = getattr(model, "config", None)
    cfg = getattr(cfg, "get_text_config", lambda: cfg)() if cfg is not None else None
    hd = getattr(cfg, "head_dim", None)
    if not hd and getattr(cfg, "num_attention_heads", None):
        hd = getattr(cfg, "hidden_size", 0) // cfg.num_attention_heads
    return int(hd) if hd else None


def _consumer_problem(name, cons, by_name, stats, uses) -> str | None:
    if not isinstance(cons, SMOOTHABLE):
        return f"{type(cons).__name__} is not a linear layer"
    if uses.get(id(cons.weight), 0) > 1:
        return "weight shared with other modules (tied)"
    st = stats.get(name)
    width = weight_2d(cons).shape[1]
    if st is None or not st.seen or st.channel_amax is None or st.channel_amax.numel() != width:
        return "no per-channel calibration statistics"
    return None


def _candidate(prod_name, prod, cons_name, cons, head_dim, uses) -> Pair | None:
    """The channel map producer -> consumer if the shapes allow one (not yet checked)."""
    if not isinstance(prod, SMOOTHABLE) or uses.get(id(prod.weight), 0) > 1 or \
            not prod.weight.dtype.is_floating_point:
        return None
    n_out, n_in = weight_2d(prod).shape[0], weight_2d(cons).shape[1]
    c = torch.arange(n_in)
    if n_out == n_in:
        return Pair(prod_name, cons_name, prod, cons, c, 1)
    if head_dim and n_in % n_out == 0 and n_out % head_dim == 0:
        rep = n_in // n_out
        return Pair(prod_name, cons_name, prod, cons,
                    (c // head_dim) // rep * head_dim + c % head_dim, rep)
    return None


def _exact(model, example, pairs: list[Pair], reference, dtype) -> bool:
    """Does dividing each producer's output by random powers of two and multiplying its
    consumer's input by the same (mapped) factors leave the model output unchanged?"""
    handles = []
    try:
        for i, p in enumerate(pairs):
            f = _pow2_factors(weight_2d(p.prod).shape[0], seed=100 + i)
            fp, fc = f.to(p.prod.weight.device), f[p.index].to(p.cons.weight.device)

            def out_hook(_m, _args, out, f=fp):
                return out / f.to(out.dtype) if torch.is_tensor(out) else out

            def in_hook(_m, args, f=fc):
                return (args[0] * f.to(args[0].dtype), *args[1:])

            handles.append(p.prod.register_forward_hook(out_hook))
            handles.append(p.cons.register_forward_pre_hook(in_hook))
        got = _flat_tensors(_run(model, example))
    except Exception:  # noqa: BLE001 - a shape the map got wrong: not this pair
        return False
    finally:
        for h in handles:
            h.remove()
    return len(got) == len(reference) and all(_close(a, b, dtype) for a, b in zip(got, reference))

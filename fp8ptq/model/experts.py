"""Mixture-of-Experts modules whose experts are fused 3-D parameters.

transformers 5 stores the routed experts of Mixtral, Qwen2-MoE, Qwen3-MoE, DeepSeek, ... not as
``nn.Linear`` modules but as one ``...Experts`` module per layer holding ``gate_up_proj``
``[E, 2*I, H]`` (or ``up_proj`` when there is no gate) and ``down_proj`` ``[E, H, I]``; its
forward picks ``W[e]`` per expert and calls ``F.linear`` (``is_transposed=False``) or
``x @ W[e]`` (``is_transposed=True``, shapes ``[E, in, out]``). The flags are set by
transformers' ``use_experts_implementation`` decorator on the module itself, so we read them
from there instead of keeping a table of architecture names.

A GEMM walk over ``nn.Linear`` never sees these weights: without this module the bulk of an MoE
model stays in high precision, silently. Here they are found, described (which projections,
which orientation), and the router GEMMs next to them are named so that they can stay in high
precision by default.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import nn


@dataclass(frozen=True)
class ExpertsInfo:
    """What an experts module looks like: its projections in forward order (the first one takes
    the layer input, the last one produces the output) and how its weights are laid out."""

    num_experts: int
    projections: tuple[str, ...]  # ("gate_up_proj", "down_proj") or ("up_proj", "down_proj")
    transposed: bool  # weights stored [E, in, out] instead of [E, out, in]
    has_gate: bool
    has_bias: bool
    # (projection, [experts, out, in]) in forward order: what checkpoints name and split, known
    # even after quantization has replaced the fused weights by codes
    shapes: tuple[tuple[str, tuple[int, int, int]], ...] = ()

    def rows(self, proj: str) -> int:
        """Output rows of one expert's projection ``proj``."""
        return dict(self.shapes)[proj][1]


def experts_info(module: nn.Module) -> ExpertsInfo | None:
    """An ``ExpertsInfo`` when ``module`` holds fused 3-D expert weights we can quantize."""
    has_gate = bool(getattr(module, "has_gate", hasattr(module, "gate_up_proj")))
    first = "gate_up_proj" if has_gate else "up_proj"
    weights = [getattr(module, n, None) for n in (first, "down_proj")]
    if not all(isinstance(w, nn.Parameter) and w.dim() == 3 for w in weights):
        return None
    if getattr(module, "has_post_expert_norm", False):
        return None  # a norm between the experts' GEMMs: not simulated here, left unquantized
    num = weights[0].shape[0]
    if weights[1].shape[0] != num:
        return None
    transposed = bool(getattr(module, "is_transposed", False))
    shapes = tuple((proj, (w.shape[0], *(w.shape[2:0:-1] if transposed else w.shape[1:])))
                   for proj, w in zip((first, "down_proj"), weights))
    return ExpertsInfo(num_experts=num, projections=(first, "down_proj"), transposed=transposed,
                       has_gate=has_gate, has_bias=bool(getattr(module, "has_bias", False)),
                       shapes=shapes)


def find_experts(model: nn.Module) -> Iterator[tuple[str, nn.Module, ExpertsInfo]]:
    for name, module in model.named_modules():
        info = experts_info(module)
        if info is not None:
            yield name, module, info


def expert_weight(module: nn.Module, info: ExpertsInfo, proj: str) -> torch.Tensor:
    """The projection's weights as ``[E, out, in]`` (a view)."""
    w = getattr(module, proj)
    return w.transpose(1, 2) if info.transposed else w


def router_names(model: nn.Module) -> list[str]:
    """GEMMs that route tokens: every ``nn.Linear`` that is a direct child of a module holding
    fused experts (``gate``, Qwen2-MoE's ``shared_expert_gate``). They decide which experts
    run, their outputs are tiny, and an error there changes the routing itself, so they stay
    in high precision by default (``--quantize-router``)."""
    names = []
    for name, module in model.named_modules():
        if not any(experts_info(c) is not None for c in module.children()):
            continue
        for child_name, child in module.named_children():
            if isinstance(child, nn.Linear):
                names.append(f"{name}.{child_name}" if name else child_name)
    return names


def expert_unit_name(experts_name: str, expert: int, proj: str) -> str:
    """The name one expert's projection goes by in reports, ``--skip`` globs and statistics:
    ``model.layers.0.mlp.experts.3.gate_up_proj``."""
    return f"{experts_name}.{expert}.{proj}"


def matches(name: str, patterns) -> bool:
    return any(fnmatch.fnmatchcase(name, p) for p in patterns)

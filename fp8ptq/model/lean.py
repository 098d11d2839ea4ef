"""Calibration forwards of Llama-shaped models with fewer full-size temporaries, bit for bit the
same outputs.

Why: ``bound_heap`` serves every allocation of 1 MiB or more from its own ``mmap`` (it bounds
the peak RSS), so each activation-sized temporary of a forward is mapped, faulted in and
unmapped again. transformers' Llama code makes many: ``apply_rotary_pos_emb`` five per query
and per key (``q * cos``, ``-x2``, the ``cat`` of ``rotate_half``, ``* sin``, the sum),
``LlamaRMSNorm`` three (``pow``, ``* rsqrt``, ``weight *``), ``LlamaMLP`` two beyond its GEMMs
(``act_fn(gate)``, ``* up``). On float32 SmolLM2-135M these element-wise ops and their page
faults were about a third of the statistics pass in a profile, nearly as much as the GEMMs
themselves (docs/results/speed.md, "calibration forwards with fewer temporaries").

``lean_forwards(model)`` replaces, for the duration of a block (the statistics pass,
``fp8ptq.steps.calibrate.collect_stats``), the forwards it recognises by their source text - the
``ast`` of transformers' Llama code, which Qwen2, Mistral and the other "copied from Llama"
models share - with versions that write into one output tensor and a reused scratch buffer:

- ``apply_rotary_pos_emb``: ``out = x * cos``, then ``out[:h] -= x2 * sin[:h]`` and
  ``out[h:] += x1 * sin[h:]`` with the products in scratch (``a + (-b) * s`` is ``a - b * s``
  exactly in IEEE arithmetic): one allocation instead of five;
- RMSNorm: ``x ** 2`` into scratch, ``out = x * rsqrt(mean + eps)``, ``out *= weight``: one
  instead of three (a bf16 / fp16 input's float32 copy in scratch too: one instead of five;
  weights of another dtype than the input's run the original);
- the MLP: ``silu`` in place on the gate projection's output, then ``*= up``: none instead of
  two (only when nothing hooks the gate projection's output, which is then changed in place).

Every replacement computes the same IEEE operations on the same operands in the same layout
as the original, so the outputs are identical bit for bit (``tests/test_lean.py``, tiny
Llama and Qwen2; also the observers' statistics and the quantized checkpoint). Anything not
recognised runs as before; the originals are back when the block exits.
``FP8PTQ_LEAN_FORWARDS=0`` turns it off (to time or compare against transformers' own code).
"""

from __future__ import annotations

import ast
import inspect
import os
import sys
import textwrap
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch import nn

# transformers' Llama code (5.x) the replacements stand in for, as source; compared by ast.
_RMSNORM = '''
def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
    input_dtype = hidden_states.dtype
    hidden_states = hidden_states.to(torch.float32)
    variance = hidden_states.pow(2).mean(-1, keepdim=True)
    hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
    return self.weight * hidden_states.to(input_dtype)
'''
_MLP = '''
def forward(self, x):
    down_proj = self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))
    return down_proj
'''
_ROPE = '''
def apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1):
    cos = cos.unsqueeze(unsqueeze_dim)
    sin = sin.unsqueeze(unsqueeze_dim)
    q_embed = (q * cos) + (rotate_half(q) * sin)
    k_embed = (k * cos) + (rotate_half(k) * sin)
    return q_embed, k_embed
'''
_SILU = '''
def forward(self, input: Tensor) -> Tensor:
    return nn.functional.silu(input)
'''
_ROTATE_HALF = '''
def rotate_half(x):
    x1 = x[..., : x.shape[-1] // 2]
    x2 = x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)
'''


def _body(source: str) -> str | None:
    """The ``ast`` dump of a function's arguments and body, its docstring and decorators left
    out (what the code does, not how it is formatted)."""
    try:
        tree = ast.parse(textwrap.dedent(source))
    except SyntaxError:
        return None
    fn = tree.body[0] if tree.body else None
    if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
        return None
    body = fn.body
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) \
            and isinstance(body[0].value.value, str):
        body = body[1:]
    return ast.dump(fn.args) + "".join(ast.dump(s) for s in body)


_EXPECTED = {name: _body(src) for name, src in
             (("rmsnorm", _RMSNORM), ("mlp", _MLP), ("rope", _ROPE), ("silu", _SILU),
              ("rotate_half", _ROTATE_HALF))}
_SEEN: dict[object, str | None] = {}


def _source_is(obj, name: str) -> bool:
    """Whether function ``obj`` is, as source, transformers' Llama ``name`` (cached)."""
    obj = inspect.unwrap(obj)
    if obj not in _SEEN:
        try:
            _SEEN[obj] = _body(inspect.getsource(obj))
        except (OSError, TypeError):
            _SEEN[obj] = None
    return _SEEN[obj] is not None and _SEEN[obj] == _EXPECTED[name]


class _Scratch:
    """Reused buffers by name and dtype; grown, never shrunk, dropped with the block."""

    def __init__(self):
        self.bufs: dict[tuple[str, torch.dtype], torch.Tensor] = {}

    def like(self, t: torch.Tensor, name: str = "tmp", dtype: torch.dtype | None = None
             ) -> torch.Tensor:
        """A contiguous tensor of ``t``'s shape, in ``dtype`` (default ``t``'s; contents
        undefined)."""
        key = (name, dtype or t.dtype)
        buf = self.bufs.get(key)
        if buf is None or buf.numel() < t.numel():
            self.bufs.pop(key, None)
            buf = self.bufs[key] = torch.empty(t.numel(), dtype=key[1], device=t.device)
        return buf[:t.numel()].view(t.shape)


def _rope(scratch: _Scratch, original):
    def apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1):
        if not all(t.device.type == "cpu" for t in (q, k, cos, sin)) or q.shape[-1] % 2:
            return original(q, k, cos, sin, unsqueeze_dim)
        cos = cos.unsqueeze(unsqueeze_dim)
        sin = sin.unsqueeze(unsqueeze_dim)
        return _rotate(q, cos, sin, scratch), _rotate(k, cos, sin, scratch)
    return apply_rotary_pos_emb


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, scratch: _Scratch):
    """``x * cos + rotate_half(x) * sin`` with one new tensor: the same products and sums."""
    out = x * cos
    h = x.shape[-1] // 2
    x1, x2 = x[..., :h], x[..., h:]
    s1, s2 = sin[..., :h], sin[..., h:]
    first = out[..., :h]
    if torch.broadcast_shapes(x2.shape, s1.shape) != first.shape:
        return x * cos + torch.cat((-x2, x1), dim=-1) * sin  # odd broadcasting: as written
    tmp = scratch.like(first)
    first.sub_(torch.mul(x2, s1, out=tmp))
    out[..., h:].add_(torch.mul(x1, s2, out=tmp))
    return out


def _rmsnorm(module: nn.Module, scratch: _Scratch, original):
    def forward(hidden_states: torch.Tensor) -> torch.Tensor:
        w = module.weight
        if w.dtype != hidden_states.dtype or not hidden_states.is_contiguous() \
                or hidden_states.device.type != "cpu" or not hidden_states.is_floating_point():
            return original(hidden_states)
        dtype = hidden_states.dtype
        h = hidden_states if dtype == torch.float32 else \
            scratch.like(hidden_states, "upcast", torch.float32).copy_(hidden_states)
        variance = torch.pow(h, 2, out=scratch.like(h, "square")).mean(-1, keepdim=True)
        r = torch.rsqrt(variance + module.variance_epsilon)
        out = h * r if dtype == torch.float32 else h.mul_(r).to(dtype)
        return out.mul_(w)
    return forward


def _mlp(module: nn.Module, original):
    def forward(x):
        gate = module.gate_proj
        if gate._forward_hooks or torch.is_grad_enabled():
            return original(x)
        g = gate(x)
        F.silu(g, inplace=True)
        return module.down_proj(g.mul_(module.up_proj(x)))
    return forward


def _silu_like(act: nn.Module) -> bool:
    """``act`` computes ``F.silu`` of its input and nothing else (torch's ``nn.SiLU`` not in
    place, or transformers' ``SiLUActivation``), and nothing replaced its forward."""
    if "forward" in act.__dict__ or act._forward_hooks or act._forward_pre_hooks:
        return False
    cls = type(act)
    if cls.forward is nn.SiLU.forward:
        return not act.inplace
    return _source_is(cls.forward, "silu")


@contextmanager
def lean_forwards(model: nn.Module, enabled: bool = True):
    """Within the block, ``model``'s Llama-shaped rotary embedding, RMSNorms and MLPs run the
    fewer-temporaries versions above (same outputs bit for bit); the originals come back on
    exit. Not for autograd (in-place ops on the gate projection's output): the statistics pass
    runs under ``torch.inference_mode``."""
    if not enabled or os.environ.get("FP8PTQ_LEAN_FORWARDS") == "0":
        yield
        return
    scratch = _Scratch()
    instance: list[nn.Module] = []
    globals_: list[tuple[dict, str, object]] = []
    modules_seen: set[str] = set()
    try:
        for m in model.modules():
            cls = type(m)
            if "forward" in m.__dict__:
                continue  # already replaced by someone (accelerate hooks, a user)
            if hasattr(m, "variance_epsilon") and isinstance(getattr(m, "weight", None),
                                                             torch.Tensor) \
                    and _source_is(cls.forward, "rmsnorm"):
                m.forward = _rmsnorm(m, scratch, cls.forward.__get__(m))
                instance.append(m)
            elif all(isinstance(getattr(m, n, None), nn.Module)
                     for n in ("gate_proj", "up_proj", "down_proj", "act_fn")) \
                    and _silu_like(m.act_fn) and _source_is(cls.forward, "mlp"):
                m.forward = _mlp(m, cls.forward.__get__(m))
                instance.append(m)
            mod = sys.modules.get(cls.__module__)
            if mod is None or cls.__module__ in modules_seen:
                continue
            modules_seen.add(cls.__module__)
            space = vars(mod)
            rope, half = space.get("apply_rotary_pos_emb"), space.get("rotate_half")
            if callable(rope) and callable(half) and _source_is(rope, "rope") \
                    and _source_is(half, "rotate_half"):
                globals_.append((space, "apply_rotary_pos_emb", rope))
                space["apply_rotary_pos_emb"] = _rope(scratch, rope)
        yield
    finally:
        for m in instance:
            m.__dict__.pop("forward", None)
        for space, name, value in globals_:
            space[name] = value
        scratch.bufs.clear()


__all__ = ["lean_forwards"]

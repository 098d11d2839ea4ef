"""Outlier rotation folded into the weights (``--rotate hadamard``).

Ashkboos et al., "QuaRot: Outlier-Free 4-Bit Inference in Rotated LLMs", 2024 (Section 4) and
Liu et al., "SpinQuant: LLM Quantization with Learned Rotations", 2024 (Section 3, R1 and R2):
an orthogonal ``Q`` applied to the residual stream (``x -> x Q``) leaves the network's function
unchanged when every residual READER gets ``W -> W Q`` and every residual WRITER (embeddings,
attention output and MLP down projections) gets ``W -> Q^T W``; a random Hadamard ``Q`` spreads
outlier channels over all channels, so per-tensor / per-channel FP8 scales waste less range.
The value/output path of attention gets a second, per-head rotation (SpinQuant's R2): ``v_proj``
rows and ``o_proj`` columns of every head are rotated by the same ``head_dim`` Hadamard.

Everything is folded offline: the checkpoint keeps the model's standard architecture (no online
transforms), so it loads in transformers / vLLM unchanged. Normalisation layers do not commute
with a rotation unless their gain is one, so the gains are folded into the following GEMMs first
(their gain becomes 1):

* RMSNorm (Llama, Qwen2, ...): ``rms(x Q) = rms(x)`` for orthogonal ``Q``; folding the gain is all.
* LayerNorm (GPT-2): QuaRot turns LayerNorm into RMSNorm by centring the residual stream, which
  changes the architecture. fp8ptq instead picks a ``Q`` that keeps the all-ones direction
  (``Q 1 = 1``): then mean-centring commutes with ``Q`` and ``LN(x Q) = LN(x) Q`` exactly, with
  no change of architecture. ``Q = P H`` where ``H`` is the random Hadamard and ``P`` the
  Householder reflection taking ``H 1`` back to ``1`` (a rank-one correction, so ``Q`` keeps
  Hadamard's incoherence up to O(1/sqrt(n))). The LayerNorm bias is folded into the following
  GEMMs' biases, or, before a bias-free lm_head, kept as the norm bias ``(b / g) Q``.

Dimensions that are not powers of two use the Kronecker product of a Sylvester Hadamard and
Paley's order-12 one, ``n = 2^a * 12^k`` (e.g. 576 = 4 x 12 x 12, SmolLM2's width), and
otherwise a random orthogonal matrix (QR of a Gaussian, sign-fixed): still
exact, only less structured. Tied embeddings are untied (the lm_head gets the final norm's gain).
Rotation runs in float64 and stores float32, so the rotated model equals the original within
float32 round-off before quantization (tested on tiny Llama, Qwen2 and GPT-2).
"""

from __future__ import annotations

import torch
from torch import nn

from ..errors import UsageError

_H12 = [  # Hadamard matrix of order 12 (Paley construction I, q = 11)
    "+-----------", "++-+---+++-+", "+++-+---+++-", "+-++-+---+++", "++-++-+---++",
    "+++-++-+---+", "++++-++-+---", "+-+++-++-+--", "+--+++-++-+-", "+---+++-++-+",
    "++---+++-++-", "+-+---+++-++"]


def _sylvester(n: int) -> torch.Tensor:
    H = torch.ones(1, 1, dtype=torch.float64)
    while H.shape[0] < n:
        H = torch.cat([torch.cat([H, H], 1), torch.cat([H, -H], 1)], 0)
    return H


def _h12() -> torch.Tensor:
    return torch.tensor([[1.0 if c == "+" else -1.0 for c in row] for row in _H12],
                        dtype=torch.float64)


def random_hadamard(n: int, generator: torch.Generator) -> torch.Tensor:
    """Orthogonal ``n x n`` (float64): random-sign Hadamard (Sylvester, or Sylvester x H12),
    or a random orthogonal matrix when no Hadamard construction of order ``n`` is known here."""
    H = _hadamard(n)
    if H is None:
        A = torch.randn(n, n, generator=generator, dtype=torch.float64)
        Q, R = torch.linalg.qr(A)
        return Q * torch.sign(torch.diag(R)).unsqueeze(0)
    signs = torch.randint(0, 2, (n,), generator=generator).double() * 2 - 1
    return (H * signs.unsqueeze(0)) / n ** 0.5


def keep_ones(Q: torch.Tensor) -> torch.Tensor:
    """``P Q``-style fix so that ``1 Q = 1`` (row vector): a Householder reflection after Q."""
    n = Q.shape[0]
    u = torch.ones(n, dtype=torch.float64) / n ** 0.5
    v = u @ Q
    w = v - u
    if float(w.norm()) < 1e-12:
        return Q
    P = torch.eye(n, dtype=torch.float64) - 2 * torch.outer(w, w) / (w @ w)
    return Q @ P  # u Q P = v P = u


# -------------------------------------------------------------------- weight edits (float64)

def _set(param: nn.Parameter | torch.Tensor, value: torch.Tensor) -> None:
    with torch.no_grad():
        param.data = value.to(param.dtype).contiguous()


def _linear_in(lin: nn.Module, Q: torch.Tensor, gain=None, bias=None, conv1d=False) -> None:
    """Reader of the rotated stream: ``W [out, in] -> W diag(gain) Q``; the norm's bias
    ``bias`` [in] folds into the GEMM's own bias."""
    W = lin.weight.double()
    W = W.T if conv1d else W  # Conv1D stores [in, out]
    Q, gain, bias = (None if t is None else t.to(W.device) for t in (Q, gain, bias))
    if bias is not None:
        extra = W @ bias
        if lin.bias is None:
            raise UsageError("cannot fold a LayerNorm bias into a GEMM without a bias")
        _set(lin.bias, lin.bias.double() + extra)
    if gain is not None:
        W = W * gain.unsqueeze(0)
    W = W @ Q
    _set(lin.weight, W.T if conv1d else W)


def _linear_out(lin: nn.Module, Q: torch.Tensor, conv1d=False) -> None:
    """Writer to the rotated stream: ``y -> y Q``, i.e. ``W -> Q^T W`` and ``b -> b Q``."""
    W = lin.weight.double()
    W = W.T if conv1d else W
    Q = Q.to(W.device)
    _set(lin.weight, (Q.T @ W).T if conv1d else Q.T @ W)
    if lin.bias is not None:
        _set(lin.bias, lin.bias.double() @ Q)


def _norm_reset(norm: nn.Module) -> tuple[torch.Tensor, torch.Tensor | None]:
    g = norm.weight.double().clone()
    b = None if getattr(norm, "bias", None) is None else norm.bias.double().clone()
    _set(norm.weight, torch.ones_like(g))
    if b is not None:
        _set(norm.bias, torch.zeros_like(b))
    return g, b


def _head_rotation(head_dim: int, heads: int, gen) -> torch.Tensor:
    Hh = random_hadamard(head_dim, gen)
    return torch.block_diag(*([Hh] * heads))


# ------------------------------------------------------------------------------ architectures

def _untie(model) -> None:
    out, emb = model.get_output_embeddings(), model.get_input_embeddings()
    if out is not None and out.weight is emb.weight:
        out.weight = nn.Parameter(emb.weight.detach().clone())
    model.config.tie_word_embeddings = False
    if hasattr(model.config, "get_text_config"):
        model.config.get_text_config().tie_word_embeddings = False


def _rotate_llama(model, gen) -> dict:
    cfg = model.config
    base = model.model
    hidden = cfg.hidden_size
    Q = random_hadamard(hidden, gen)
    _untie(model)
    emb = base.embed_tokens
    _set(emb.weight, emb.weight.double() @ Q.to(emb.weight.device))
    head_dim = getattr(cfg, "head_dim", None) or hidden // cfg.num_attention_heads
    kv_heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
    for layer in base.layers:
        attn, mlp = layer.self_attn, layer.mlp
        g, _ = _norm_reset(layer.input_layernorm)
        for lin in (attn.q_proj, attn.k_proj, attn.v_proj):
            _linear_in(lin, Q, gain=g)
        # value/output path, per head (same Hh for every head; GQA shares it)
        Hv = _head_rotation(head_dim, kv_heads, gen_fork(gen))
        Ho = torch.block_diag(*([Hv[:head_dim, :head_dim]] * cfg.num_attention_heads))
        _linear_out(attn.v_proj, Hv)
        Wo = attn.o_proj.weight.double()
        _set(attn.o_proj.weight, Wo @ Ho.to(Wo.device))
        _linear_out(attn.o_proj, Q)
        g, _ = _norm_reset(layer.post_attention_layernorm)
        for lin in (mlp.gate_proj, mlp.up_proj):
            _linear_in(lin, Q, gain=g)
        _linear_out(mlp.down_proj, Q)
    g, _ = _norm_reset(base.norm)
    _linear_in(model.lm_head, Q, gain=g)
    return {"hidden": hidden, "head_dim": head_dim, "kind": _kind(hidden)}


def _rotate_gpt2(model, gen) -> dict:
    cfg = model.config
    tr = model.transformer
    hidden = cfg.n_embd
    Q = keep_ones(random_hadamard(hidden, gen))
    _untie(model)
    for emb in (tr.wte, tr.wpe):
        _set(emb.weight, emb.weight.double() @ Q.to(emb.weight.device))
    heads = cfg.n_head
    head_dim = hidden // heads
    for block in tr.h:
        attn, mlp = block.attn, block.mlp
        g, b = _norm_reset(block.ln_1)
        _linear_in(attn.c_attn, Q, gain=g, bias=b, conv1d=True)
        W = attn.c_attn.weight.double()  # [in, 3*hidden]: q | k | v
        Hv = _head_rotation(head_dim, heads, gen_fork(gen)).to(W.device)
        Wv = W[:, 2 * hidden:] @ Hv
        _set(attn.c_attn.weight, torch.cat([W[:, :2 * hidden], Wv], 1))
        bb = attn.c_attn.bias.double()
        _set(attn.c_attn.bias, torch.cat([bb[:2 * hidden], bb[2 * hidden:] @ Hv]))
        _set(attn.c_proj.weight, Hv.T @ attn.c_proj.weight.double())  # Conv1D: x @ W
        _linear_out(attn.c_proj, Q, conv1d=True)
        g, b = _norm_reset(block.ln_2)
        _linear_in(mlp.c_fc, Q, gain=g, bias=b, conv1d=True)
        _linear_out(mlp.c_proj, Q, conv1d=True)
    g, b = _norm_reset(tr.ln_f)
    _linear_in(model.lm_head, Q, gain=g)
    if b is not None and bool((b != 0).any()):
        if bool((g == 0).any()):
            raise UsageError("cannot rotate: the final LayerNorm has a bias and a zero gain")
        # n(x)Q + (b/g)Q, then lm_head W g Q^T: = W(g n + b)
        _set(tr.ln_f.bias, (b / g) @ Q.to(b.device))
    return {"hidden": hidden, "head_dim": head_dim, "kind": _kind(hidden) + ", keeps 1"}


def gen_fork(gen: torch.Generator) -> torch.Generator:
    """A child generator, so each layer's head rotation is independent but reproducible."""
    g = torch.Generator()
    g.manual_seed(int(torch.randint(0, 2**62, (1,), generator=gen)))
    return g


def _twelves(n: int) -> int | None:
    """k such that n = 2^a * 12^k (a Sylvester x Paley-12^k Hadamard exists), else None."""
    k = 0
    while n & (n - 1):
        if n % 12:
            return None
        n, k = n // 12, k + 1
    return k


def _hadamard(n: int) -> torch.Tensor | None:
    k = _twelves(n)
    if k is None:
        return None
    H = _sylvester(n // 12 ** k)
    for _ in range(k):
        H = torch.kron(H, _h12())
    return H


def _kind(n: int) -> str:
    k = _twelves(n)
    if k is None:
        return "random orthogonal (no Hadamard of this order here)"
    return "random Hadamard (Sylvester" + (f" x Paley-12^{k})" if k else ")")


_ROTATORS = {"llama": _rotate_llama, "qwen2": _rotate_llama, "mistral": _rotate_llama,
             "qwen3": _rotate_llama, "gpt2": _rotate_gpt2}


@torch.no_grad()
def rotate_model(model: nn.Module, method: str = "hadamard", seed: int = 0) -> dict:
    """Fold a random Hadamard rotation into ``model`` in place; returns a small report."""
    if method != "hadamard":
        raise UsageError(f"--rotate supports 'hadamard', got {method!r}")
    mtype = getattr(getattr(model, "config", None), "model_type", None)
    fn = _ROTATORS.get(mtype)
    if fn is None:
        raise UsageError(f"--rotate hadamard supports model types "
                         f"{', '.join(_ROTATORS)}; got {mtype!r}")
    gen = torch.Generator()
    gen.manual_seed(seed)
    info = fn(model, gen)
    info.update(method=method, seed=seed, model_type=mtype)
    return info

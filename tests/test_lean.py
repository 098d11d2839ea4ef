"""Calibration forwards with fewer temporaries (``fp8ptq.model.lean``): on tiny Llama and Qwen2
models the replaced rotary embedding, RMSNorms and MLPs give the same outputs bit for bit as
transformers' own code, the quantize pipeline's statistics do not change, and everything is
put back afterwards."""

import pytest
import torch
import transformers.models.llama.modeling_llama as llama
import transformers.models.qwen2.modeling_qwen2 as qwen2

from fp8ptq.config.recipe import Recipe
from fp8ptq.execution.in_memory import quantize_model, token_batches
from fp8ptq.model import lean
from fp8ptq.model.lean import lean_forwards
from tiny_models import IDS, STATIC_RECIPE, tiny


def _hidden(model, ids):
    with torch.inference_mode():
        return model.model(input_ids=ids).last_hidden_state


def _replaced(model):
    return sum("forward" in m.__dict__ for m in model.modules())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("arch, module", [("llama", llama), ("qwen2", qwen2)])
def test_same_outputs_bit_for_bit_and_restored(arch, module, dtype):
    model = tiny(arch, hidden_size=128, num_attention_heads=4, intermediate_size=256,
                 dtype=dtype)
    # weights away from 1 / 0 so that every product is a real rounding
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    ids = torch.randint(2, 128, (3, 40), generator=torch.Generator().manual_seed(2))
    before = _hidden(model, ids)
    original = module.apply_rotary_pos_emb
    calls = []
    with lean_forwards(model):
        layers = model.config.num_hidden_layers
        assert _replaced(model) == 3 * layers + 1  # 2 norms + MLP per layer, final norm
        assert module.apply_rotary_pos_emb is not original
        wrapped = module.apply_rotary_pos_emb

        def counting(*args, **kwargs):
            calls.append(1)
            return wrapped(*args, **kwargs)
        module.apply_rotary_pos_emb = counting
        during = _hidden(model, ids)
        module.apply_rotary_pos_emb = wrapped
    assert len(calls) == layers
    assert torch.equal(during, before)
    assert module.apply_rotary_pos_emb is original
    assert _replaced(model) == 0
    assert torch.equal(_hidden(model, ids), before)


def test_pieces_match_transformers_functions():
    """Each replacement against the function it stands in for, on awkward layouts: a
    transposed (non-contiguous) query as LlamaAttention passes it, grouped keys, broadcast
    cos / sin."""
    g = torch.Generator().manual_seed(3)
    q = torch.randn(2, 7, 6, 32, generator=g).transpose(1, 2)  # (batch, heads, seq, dim)
    k = torch.randn(2, 7, 2, 32, generator=g).transpose(1, 2)
    ang = torch.randn(1, 7, 16, generator=g)
    cos, sin = torch.cat((ang, ang), -1).cos(), torch.cat((ang, ang), -1).sin()
    scratch = lean._Scratch()
    rope = lean._rope(scratch, llama.apply_rotary_pos_emb)
    for got, want in zip(rope(q, k, cos, sin), llama.apply_rotary_pos_emb(q, k, cos, sin)):
        assert torch.equal(got, want)
        assert got.stride() == want.stride()
    norm = llama.LlamaRMSNorm(48, eps=1e-5)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(48, generator=g))
    x = torch.randn(3, 5, 48, generator=g) * 7
    fast = lean._rmsnorm(norm, scratch, norm.forward)
    assert torch.equal(fast(x), norm(x))
    assert torch.equal(fast(x.to(torch.bfloat16)), norm(x.to(torch.bfloat16)))  # original
    for dtype in (torch.bfloat16, torch.float16):
        norm.to(dtype)
        assert torch.equal(fast(x.to(dtype)), norm(x.to(dtype)))


def test_mlp_left_alone_when_its_gate_output_is_hooked():
    """The MLP replacement changes the gate projection's output in place: with a forward hook
    on it (someone may keep that tensor) the original forward runs."""
    model = tiny("llama")
    mlp = model.model.layers[0].mlp
    seen = []
    handle = mlp.gate_proj.register_forward_hook(lambda m, i, o: seen.append(o.clone()) or None)
    kept = []
    handle2 = mlp.gate_proj.register_forward_hook(lambda m, i, o: kept.append(o))
    x = torch.randn(2, 5, 64)
    want = mlp(x)
    try:
        with torch.inference_mode(), lean_forwards(model):
            got = mlp(x)
    finally:
        handle.remove()
        handle2.remove()
    assert torch.equal(got, want)
    assert torch.equal(kept[-1], seen[-1])  # the gate output was not silu'd in place


def test_unknown_code_is_not_replaced(monkeypatch):
    """A model whose RMSNorm computes something else (here: a different epsilon placement)
    keeps its own forward."""
    model = tiny("llama")

    def other(self, hidden_states):
        variance = hidden_states.pow(2).mean(-1, keepdim=True) + 1.0
        return self.weight * hidden_states * torch.rsqrt(variance)
    monkeypatch.setattr(llama.LlamaRMSNorm, "forward", other)
    monkeypatch.setattr(llama, "rotate_half", lambda x: torch.cat((x, x), -1)[..., :x.shape[-1]])
    original = llama.apply_rotary_pos_emb
    with lean_forwards(model):
        norms = [m for m in model.modules() if isinstance(m, llama.LlamaRMSNorm)]
        assert not any("forward" in m.__dict__ for m in norms)
        assert llama.apply_rotary_pos_emb is original
        assert any("forward" in m.__dict__ for m in model.modules())  # the MLPs still


def test_quantize_statistics_unchanged(monkeypatch):
    """The whole static pipeline on a tiny Llama: input scales and quantized weights the same
    with and without the lean forwards."""
    def quantized(enabled):
        if not enabled:
            monkeypatch.setattr(lean, "_EXPECTED", {k: "none" for k in lean._EXPECTED})
        model = tiny("llama")
        quantize_model(model, Recipe(format="e4m3", **STATIC_RECIPE),
                       list(token_batches(IDS, 4)))
        monkeypatch.undo()
        return {k: v.clone() for k, v in model.state_dict().items()}

    on, off = quantized(True), quantized(False)
    assert on.keys() == off.keys()
    assert any(k.endswith("input_scale") for k in on)
    for k in on:
        assert torch.equal(on[k], off[k]), k


def test_silu_check():
    assert lean._silu_like(torch.nn.SiLU())
    assert not lean._silu_like(torch.nn.SiLU(inplace=True))
    assert not lean._silu_like(torch.nn.GELU())
    from transformers.activations import ACT2FN
    assert lean._silu_like(ACT2FN["silu"])
    assert not lean._silu_like(ACT2FN["gelu"])

"""--rotate hadamard: the rotation folded into the weights leaves the model's function unchanged
(fp32 logits), keeps the architecture, and spreads outliers."""

import pytest
import torch
from transformers import AutoModelForCausalLM

import fp8ptq
from fp8ptq.algorithms.rotation import keep_ones, random_hadamard, rotate_model
from fp8ptq.checkpoint import save_quantized
from fp8ptq.config.recipe import Recipe
from fp8ptq.errors import UsageError
from fp8ptq.execution.in_memory import quantize_model, token_batches
from fp8ptq.execution.streaming import quantize_sequential
from tiny_models import IDS, tiny


def _gen(seed=0):
    g = torch.Generator()
    g.manual_seed(seed)
    return g


@pytest.mark.parametrize("n", [1, 2, 8, 64, 12, 48, 96, 576, 10, 20])
def test_rotation_matrices_are_orthogonal(n):
    Q = random_hadamard(n, _gen())
    assert torch.allclose(Q @ Q.T, torch.eye(n, dtype=torch.float64), atol=1e-12)
    if n in (2, 8, 64, 12, 48, 96, 576):  # Hadamard: every entry +-1/sqrt(n)
        assert torch.allclose(Q.abs(), torch.full((n, n), n ** -0.5, dtype=torch.float64))
    K = keep_ones(Q)
    assert torch.allclose(K @ K.T, torch.eye(n, dtype=torch.float64), atol=1e-12)
    ones = torch.ones(n, dtype=torch.float64)
    assert torch.allclose(ones @ K, ones)


def _tiny(kind):
    if kind == "llama":
        model = tiny("llama", dtype=torch.float32, vocab_size=97, intermediate_size=96,
                     num_key_value_heads=2, tie_word_embeddings=True)
    elif kind == "qwen2":
        model = tiny("qwen2", dtype=torch.float32, vocab_size=97, hidden_size=48,
                     intermediate_size=80, tie_word_embeddings=False)
    else:
        model = tiny("gpt2", dtype=torch.float32, vocab_size=97, n_positions=64)
    with torch.no_grad():  # non-trivial norms (gains, biases) so folding is really exercised
        for name, p in model.named_parameters():
            if "norm" in name or "ln_" in name:
                p.copy_(torch.rand_like(p) + 0.5 if name.endswith("weight")
                        else torch.randn_like(p) * 0.1)
            elif name.endswith("bias"):
                p.copy_(torch.randn_like(p) * 0.05)
    return model


@pytest.mark.parametrize("kind", ["llama", "qwen2", "gpt2"])
def test_rotated_logits_equal_unrotated(kind, tmp_path):
    model = _tiny(kind)
    ids = torch.randint(0, 97, (2, 24), generator=_gen(1))
    with torch.no_grad():
        ref = model(ids).logits
    classes = {n: type(m) for n, m in model.named_modules()}
    info = rotate_model(model, "hadamard", seed=3)
    assert info["model_type"] == kind
    with torch.no_grad():
        out = model(ids).logits
    assert {n: type(m) for n, m in model.named_modules()} == classes  # same architecture
    err = (out - ref).abs().max().item()
    assert err < 1e-4 * ref.abs().max().item() + 1e-5, err
    # the weights really changed (not a no-op), and the checkpoint reloads unchanged
    emb = model.get_input_embeddings().weight
    assert model.get_output_embeddings().weight.data_ptr() != emb.data_ptr()
    model.save_pretrained(tmp_path)
    again = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    with torch.no_grad():
        assert torch.allclose(again(ids).logits, out, atol=1e-5)


def test_rotation_spreads_an_outlier_channel():
    model = _tiny("llama")
    with torch.no_grad():
        model.model.embed_tokens.weight[:, 5] *= 50  # one outlier channel in the residual
    ids = torch.randint(0, 97, (1, 16), generator=_gen(2))
    cap = {}
    h = model.model.layers[0].self_attn.q_proj.register_forward_pre_hook(
        lambda m, a: cap.__setitem__("x", a[0].detach()))
    model(ids)
    before = cap["x"].abs().amax() / cap["x"].abs().mean()
    rotate_model(model, seed=0)
    model(ids)
    after = cap["x"].abs().amax() / cap["x"].abs().mean()
    h.remove()
    assert after < before / 3


def test_unsupported_model_type_is_a_usage_error():
    with pytest.raises(UsageError):
        rotate_model(torch.nn.Linear(2, 2))
    with pytest.raises(UsageError):
        rotate_model(_tiny("gpt2"), "givens")


def test_pipeline_rotate_then_quantize_round_trips(tmp_path):
    """--rotate hadamard in the pipeline: the rotated-then-quantized model saves as a standard
    checkpoint (untied lm_head), reloads bit-equal, and its report says what was rotated."""
    batches = list(token_batches(IDS, 4))
    ref = tiny("llama").float()
    with torch.no_grad():
        want = ref(input_ids=IDS).logits
    recipe = Recipe(format="e4m3", act_format="none", dtype="float32", rotate="hadamard")
    model = tiny("llama").float()
    result = quantize_model(model, recipe, batches)
    assert result.extras["rotation"]["method"] == "hadamard"
    with torch.no_grad():
        got = model(input_ids=IDS).logits
    assert float(((got - want) ** 2).mean()) < float((want ** 2).mean()) * 0.05
    save_quantized(result, recipe, tmp_path / "ck")
    with torch.no_grad():
        assert torch.equal(fp8ptq.load(tmp_path / "ck").model(input_ids=IDS).logits, got)
    with pytest.raises(UsageError):
        Recipe(rotate="givens")


def test_sequential_mode_refuses_rotation(tmp_path):
    tiny("llama").save_pretrained(tmp_path)
    with pytest.raises(UsageError, match="--rotate"):
        quantize_sequential(tmp_path, Recipe(rotate="hadamard", act_format="none"), None)

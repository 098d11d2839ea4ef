"""Sink-aware GPTQ (``fp8ptq.algorithms.gptq.sink``, ``--gptq-sink W``): the Hessian and target
handed to each GEMM add the first tokens' rows as hand-computed, weight 0 is plain GPTQ, the
first token's output through the GEMM's own input rounding gets closer to the unquantized one
at a small price on the other tokens, and a quantized tiny Llama's first-position output is
closer to the float model's than with plain GPTQ; aimed at the float model
(``--gptq-sink-target float``), the first-token stream gives the full forward's first-position
inputs exactly, and the first position comes closer still, in memory and streamed alike."""

import json

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from fp8ptq.algorithms.gptq.aim import SINK_WEIGHT, Aim
from fp8ptq.algorithms.gptq.asym import asymmetric_target
from fp8ptq.algorithms.gptq.sink import FirstTokenStream, SinkCollector, first_token_inputs
from fp8ptq.algorithms.gptq.sweep import gptq_codes
from fp8ptq.config.plan import build_plan
from fp8ptq.config.recipe import Recipe
from fp8ptq.errors import UsageError
from fp8ptq.execution import in_memory
from fp8ptq.execution.in_memory import quantize_model, token_batches
from fp8ptq.formats import decode, get_format
from fp8ptq.formats.granularity import act_granularity
from fp8ptq.model.blocks import find_blocks
from fp8ptq.nn.quant_gemm import fake_quantize_dynamic
from fp8ptq.observe.hessian import HessianCollector
from tiny_models import IDS, invoke, saved_llama_with_calib, tiny

E4M3 = get_format("e4m3")
BATCHES = list(token_batches(IDS, 4))
QUANTIZE_TARGET = in_memory.quantize_target


def per_token(x: torch.Tensor) -> torch.Tensor:
    return fake_quantize_dynamic(x, act_granularity("token", 128), E4M3)


def collect(collector, x: torch.Tensor):
    """Feed ``x`` [batch, seq, features] through a Linear observed by ``collector``."""
    lin = torch.nn.Linear(x.shape[-1], 3, bias=False)
    collector.modules = {"lin": lin}
    with collector.observing(), torch.inference_mode():
        lin(x)
    return collector


def sink_inputs(seed: int, batch=8, seq=64, k=128, outlier=1.0) -> torch.Tensor:
    """Rows with a first token that is the same vector in every sequence, one of its channels
    ``outlier`` times the others (an attention sink's hidden state)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, seq, k, generator=g) * torch.linspace(0.2, 2, k)
    first = torch.randn(k, generator=g) * torch.linspace(0.2, 2, k)
    first[3] = outlier * first.abs().max()
    x[:, 0] = first
    return x


def test_hessian_and_cross_term_are_the_hand_computed_sums():
    x = sink_inputs(0)
    w = 0.5
    got = collect(SinkCollector({}, {"lin": per_token}, w), x)
    rows = x.reshape(-1, x.shape[-1]).double()
    f, q = x[:, 0].double(), per_token(x[:, :1]).reshape(-1, x.shape[-1]).double()
    H = 2 * rows.T @ rows / len(rows)
    # float32 products summed in float64, as the collector does: equal to 1e-5
    torch.testing.assert_close(got.hessian("lin"), H + 2 * w * q.T @ q / len(q),
                               rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got.cross_term("lin"), H + 2 * w * f.T @ q / len(q),
                               rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dead", [False, True])
def test_low_rank_target_is_the_dense_one(dead):
    """``SinkCollector.aim`` (from the kept rows, a solve for n right-hand sides) gives the
    ``W*`` of ``asymmetric_target`` on the dense ``H~`` and ``C``, also with an input channel
    that was always zero (its column of ``W0`` kept), and leaves ``W0`` alone."""
    x = sink_inputs(2, outlier=2.0)
    if dead:
        x[..., 5] = 0.0
    got = collect(SinkCollector({}, {"lin": per_token}, 1.0), x)
    w0 = torch.randn(6, x.shape[-1], dtype=torch.float64)
    keep = w0.clone()
    want = asymmetric_target(w0, got.hessian("lin"), got.cross_term("lin"), 0.01)
    aim = got.aim("lin", w0, 0.01)
    torch.testing.assert_close(aim, want, rtol=1e-9, atol=1e-9)
    assert not torch.equal(aim, w0) and torch.equal(w0, keep)
    if dead:
        assert torch.equal(aim[:, 5], w0[:, 5])


def test_hessian_is_computed_once_per_input():
    """q/k/v share one input: ``H~`` is built once and handed to each (the sweep does not
    modify it)."""
    x = sink_inputs(3)
    lins = {n: torch.nn.Linear(x.shape[-1], 3, bias=False) for n in ("q", "k")}
    c = SinkCollector(lins, {"q": per_token}, 1.0)
    with c.observing(), torch.inference_mode():
        for lin in lins.values():
            lin(x)
    assert c.hessian("q") is c.hessian("k")


def test_weight_zero_is_plain_gptq():
    x = sink_inputs(1)
    plain = collect(HessianCollector({}), x).hessian("lin")
    got = collect(SinkCollector({}, {"lin": per_token}, 0.0), x)
    assert torch.equal(got.hessian("lin"), plain)
    w0 = torch.randn(4, x.shape[-1], dtype=torch.float64)
    assert torch.equal(asymmetric_target(w0, got.hessian("lin"), got.cross_term("lin"), 0.01),
                       w0)


@settings(max_examples=6, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), outlier=st.floats(1.0, 3.0))
@example(seed=0, outlier=1.0)
def test_first_token_output_gets_exact_at_a_small_price(seed, outlier):
    """The layer property: with the GEMM's per-token e4m3 input rounding, sink-aware GPTQ's
    first-token output error ``||Q q(x_b) - W x_b||`` is a tenth of plain GPTQ's or less, and
    the other tokens' ``||(W - Q) x||`` stays within 10% of plain GPTQ's (same scales). The
    price grows with a massive channel in the first token (docs/recipes.md): such a column's
    rounding, times the massive value, is what the other columns then compensate."""
    x = sink_inputs(seed, outlier=outlier)
    g = torch.Generator().manual_seed(seed + 1)
    w0 = torch.randn(16, x.shape[-1], generator=g, dtype=torch.float64)
    scale = (w0.abs().amax(1, keepdim=True) / 448).expand_as(w0)
    plain_h = collect(HessianCollector({}), x).hessian("lin")
    sink = collect(SinkCollector({}, {"lin": per_token}, 1.0), x)
    first, qfirst = x[0, 0].double(), per_token(x[:1, :1]).reshape(-1).double()
    rest = x[:, 1:].reshape(-1, x.shape[-1]).double()

    def errors(aim, h):
        codes = gptq_codes(aim, h, scale, E4M3, damp=0.01, act_order=True)
        q = decode(codes, E4M3).double() * scale
        return (float((q @ qfirst - w0 @ first).norm()),
                float(((rest @ (w0 - q).T) ** 2).sum()))

    # the sequential sweep's path: W* from the kept rows, H~ for the sweep
    sink_first, sink_rest = errors(sink.aim("lin", w0, 0.01), sink.hessian("lin"))
    plain_first, plain_rest = errors(w0, plain_h)
    assert sink_first < 0.1 * plain_first
    assert sink_rest <= 1.1 * plain_rest


def _first_position_error(model, ref) -> float:
    with torch.inference_mode():
        return sum(float(((model(**b).logits[:, 0] - ref(**b).logits[:, 0]) ** 2).mean())
                   for b in BATCHES)


@pytest.mark.slow
def test_quantized_first_position_is_closer_to_the_float_model():
    ref = tiny("llama").float()
    errors = {}
    for w in (0.0, 1.0):
        model = tiny("llama").float()
        result = quantize_model(model, Recipe(format="e4m3", act_granularity="token",
                                              dtype="float32", weight_calib="gptq",
                                              gptq_sink=w), BATCHES)
        errors[w] = _first_position_error(model, ref)
        if w:
            facts = result.extras["gptq"]["sequential"]
            assert 0 < facts["aim_correction"]["mean"] <= facts["aim_correction"]["max"] < 0.5
    assert errors[1.0] < errors[0.0]


def test_default_weight_is_for_causal_language_models_only():
    """A causal LM's first token attends to itself alone: sink-aware by default there; an
    encoder's first token sees the whole sequence: plain GPTQ unless asked for."""
    recipe = Recipe(format="e4m3", weight_calib="gptq")

    def aim(arch, r=recipe):
        return Aim.of(r, build_plan(tiny(arch), r).facts.causal_lm)

    assert aim("llama") == Aim("sink", recipe.gptq_damp, SINK_WEIGHT)
    assert aim("gpt2").weight == SINK_WEIGHT
    assert aim("bert") is None
    assert aim("bert", recipe.merged(gptq_sink=0.5)).weight == 0.5
    assert aim("llama", recipe.merged(gptq_sink=0)) is None
    assert aim("llama", recipe.merged(gptq_asym=True)).kind == "asym"
    assert aim("llama", recipe.merged(weight_calib="hmse")) is None  # no column sweep
    # a streamed block's part of the plan keeps the whole model's fact
    part = build_plan(tiny("llama"), recipe).part(lambda n: n.startswith("model.layers.0."),
                                                  "model.layers.0.")
    assert part.facts.causal_lm and part.gemms


def test_recipe_refuses_what_cannot_go_together():
    with pytest.raises(UsageError, match="sequential"):
        Recipe(gptq_sink=1.0, gptq_sequential=False)
    with pytest.raises(UsageError, match="pick one"):
        Recipe(gptq_sink=1.0, gptq_asym=True)
    for bad in (-1.0, float("nan"), float("inf")):
        with pytest.raises(UsageError, match="gptq_sink"):
            Recipe(gptq_sink=bad)


def test_cli_flag_is_recorded(tmp_path, word_tokenizer):
    src, calib = saved_llama_with_calib(tmp_path, word_tokenizer)
    out = tmp_path / "out"
    r = invoke(["quantize", src, "-o", out, "--gptq-sink", "1", "--calib-data", calib,
                "--num-samples", 2, "--seq-len", 8, "--dtype", "float32", "--json"])
    assert r.exit_code == 0, r.output
    doc = json.loads((out / "fp8ptq.json").read_text())
    assert doc["recipe"]["gptq_sink"] == 1.0
    r = invoke(["quantize", src, "-o", tmp_path / "bad", "--gptq-sink", "1", "--gptq-asym",
                "--calib-data", calib, "--num-samples", 2, "--seq-len", 8])
    assert r.exit_code != 0 and "error:" in r.output and not (tmp_path / "bad").exists()
    r = invoke(["quantize", src, "-o", tmp_path / "bad", "--gptq-sink", "abc",
                "--calib-data", calib])
    assert r.exit_code != 0 and "is not a valid float" in r.output


@pytest.mark.slow
def test_a_streamed_model_is_sink_aware_too(tmp_path, word_tokenizer):
    """``--sequential`` quantizes one block at a time as a model of its own; the causal-LM
    default comes from the whole model's plan, so each block is still sink-aware."""
    src, calib = saved_llama_with_calib(tmp_path, word_tokenizer)
    out = tmp_path / "out"
    r = invoke(["quantize", src, "-o", out, "--sequential", "--calib-data", calib,
                "--num-samples", 2, "--seq-len", 8, "--dtype", "float32"])
    assert r.exit_code == 0, r.output
    blocks = json.loads((out / "fp8ptq.json").read_text())["extras"]["blocks"]
    aims = {b["gptq"]["sequential"]["aim"]["weight"] for b in blocks.values() if "gptq" in b}
    assert aims == {SINK_WEIGHT}


def test_hessian_replaces_the_plain_sum():
    """``H~`` is built in the plain sum's own memory: one ``in x in`` matrix per input stays
    held, not two (what a 14,336-input ``down_proj`` pays 1.6 GB for), and it equals the sum
    scaled as ``HessianCollector`` scales it plus the first rows', bit for bit."""
    x = sink_inputs(4)
    plain = collect(HessianCollector({}), x).hessian("lin")
    got = collect(SinkCollector({}, {"lin": per_token}, 1.0), x)
    before = got.nbytes
    first = got.first_rows["lin"][0][1].double()
    h = got.hessian("lin")
    assert "lin" not in got.sums and got.nbytes == before == h.numel() * 8
    assert torch.equal(h, plain.addmm(first[1].T, first[1], alpha=2.0 / first.shape[1]))


def test_aim_solves_once_per_input_with_the_same_targets(monkeypatch):
    """The sink-aware target's ``A^-1 Q_B^T`` depends on the input alone: q and k (one input)
    share one Cholesky and solve, and each gets the ``W*`` it would get alone."""
    from fp8ptq.algorithms.gptq import sink as sink_module
    x = sink_inputs(2)
    lins = {n: torch.nn.Linear(x.shape[-1], 3, bias=False) for n in ("q", "k")}

    def collected():
        c = SinkCollector(lins, {"q": per_token}, 1.0)
        with c.observing(), torch.inference_mode():
            for lin in lins.values():
                lin(x)
        return c

    w = {n: torch.randn(3, x.shape[-1], dtype=torch.float64) for n in lins}
    alone = {n: collected().aim(n, w[n], 0.01) for n in lins}
    calls = []
    real = sink_module.damped_cholesky
    monkeypatch.setattr(sink_module, "damped_cholesky",
                        lambda *a: calls.append(1) or real(*a))
    c = collected()
    shared = {n: c.aim(n, w[n], 0.01) for n in lins}
    assert len(calls) == 1
    assert all(torch.equal(shared[n], alone[n]) for n in lins)


def _tiny_gemma3():
    """A two-block gemma-3 text model: sliding-window and global layers, each with its own
    rotary table, and (1 + w) RMSNorms."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig
    torch.manual_seed(0)
    cfg = Gemma3TextConfig(vocab_size=128, hidden_size=64, intermediate_size=96,
                           num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                           head_dim=16, sliding_window=8, max_position_embeddings=256,
                           layer_types=["sliding_attention", "full_attention"])
    return Gemma3ForCausalLM(cfg).eval().float()


def _block_gemms(block) -> dict:
    return {n: m for n, m in block.named_modules()
            if isinstance(m, torch.nn.Linear) or type(m).__name__ == "Conv1D"}


@pytest.mark.parametrize("arch", ["llama", "gpt2", "gemma3"])
def test_first_token_stream_gives_the_full_forwards_first_position_inputs(arch):
    """A first token attends to itself alone: the stream's one-token forwards, block by block,
    give every GEMM's first-position input of the full-length forward (sliding windows,
    learned positions and per-layer rotary tables included)."""
    model = _tiny_gemma3() if arch == "gemma3" else tiny(arch).float()
    _, blocks = find_blocks(model)
    full: dict = {}
    handles = [m.register_forward_pre_hook(
        lambda _m, a, k=(i, n): full.setdefault(k, []).append(a[0][:, 0].float()))
        for i, b in enumerate(blocks) for n, m in _block_gemms(b).items()]
    with torch.inference_mode():
        for b in BATCHES:
            model(**b)
    for h in handles:
        h.remove()
    stream = FirstTokenStream(model, blocks[0], BATCHES)
    for i, block in enumerate(blocks):
        got = stream.through(block, _block_gemms(block))
        assert set(got) == set(_block_gemms(block))
        for name, rows in got.items():
            want = torch.cat(full[(i, name)])
            assert torch.allclose(torch.cat([rows[j] for j in sorted(rows)]), want,
                                  rtol=1e-5, atol=1e-6), (i, name)
    # a model without repeated blocks: the whole unit's first positions in one forward
    down = "mlp.c_proj" if arch == "gpt2" else "mlp.down_proj"
    whole = first_token_inputs(model, _block_gemms(blocks[0]), BATCHES)
    assert torch.allclose(whole[down][1], full[(0, down)][1], rtol=1e-5, atol=1e-6)


def _sink_recipe(target: str) -> Recipe:
    return Recipe(format="e4m3", act_granularity="token", dtype="float32", weight_calib="gptq",
                  gptq_sink=1.0, gptq_sink_target=target)


def test_aimed_at_the_float_model_the_first_position_comes_closer():
    """``layer`` keeps each GEMM's first-token output on the input the quantized model gives
    it, drift included; ``float`` aims at the float model's, so the quantized model's first
    position ends nearer the float model's, the other positions no worse than 10% (a tiny
    Llama; its first tokens differ by sequence)."""
    ref = tiny("llama").float()
    errors, facts = {}, {}
    for target in ("layer", "float"):
        model = tiny("llama").float()
        result = quantize_model(model, _sink_recipe(target), BATCHES)
        facts[target] = result.extras["gptq"]["sequential"]["aim"]
        with torch.inference_mode():
            errors[target] = [sum(float(((model(**b).logits[:, pos] - ref(**b).logits[:, pos])
                                         ** 2).mean()) for b in BATCHES)
                              for pos in (0, slice(1, None))]
    assert facts == {t: {"kind": "sink", "weight": 1.0, "target": t} for t in facts}
    assert errors["float"][0] < 0.5 * errors["layer"][0]
    assert errors["float"][1] < 1.1 * errors["layer"][1]


def test_a_streamed_block_aims_at_the_float_model_as_in_memory(tmp_path):
    """``--sequential`` streams each block as a model of its own, past the embeddings: the
    stream hands it the float first-token inputs, and the codes are those of the in-memory
    run (``layer``, whose codes differ, shows the comparison can fail)."""
    from fp8ptq.execution.streaming import quantize_sequential
    from fp8ptq.nn.quant_gemm import QuantGemm

    folder = tmp_path / "llama"
    tiny("llama").save_pretrained(folder)

    def codes(model):
        return {n: m.weight_codes for n, m in model.named_modules() if isinstance(m, QuantGemm)}

    ref = tiny("llama").float()
    quantize_model(ref, _sink_recipe("float"), BATCHES)
    streamed, _ = quantize_sequential(folder, _sink_recipe("float"), BATCHES)
    layer, _ = quantize_sequential(folder, _sink_recipe("layer"), BATCHES)
    want, got, other = codes(ref), codes(streamed.model), codes(layer.model)
    assert want and set(want) == set(got)
    assert all(torch.equal(want[n], got[n]) for n in want)
    assert not all(torch.equal(want[n], other[n]) for n in want)
    blocks = streamed.extras["blocks"]
    assert {b["gptq"]["sequential"]["aim"]["target"] for b in blocks.values()} == {"float"}


def test_sink_target_is_a_checked_choice(tmp_path, word_tokenizer):
    with pytest.raises(UsageError, match="gptq_sink_target"):
        Recipe(gptq_sink_target="model")
    src, calib = saved_llama_with_calib(tmp_path, word_tokenizer)
    out = tmp_path / "out"
    r = invoke(["quantize", src, "-o", out, "--gptq-sink-target", "float", "--calib-data",
                calib, "--num-samples", 2, "--seq-len", 8, "--dtype", "float32"])
    assert r.exit_code == 0, r.output
    assert json.loads((out / "fp8ptq.json").read_text())["recipe"]["gptq_sink_target"] == "float"

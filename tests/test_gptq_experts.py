"""GPTQ for fused MoE experts (``fp8ptq.algorithms.gptq.experts``): each expert's Hessians from
the tokens the router sends it (or every token), summed in sequential GPTQ's run order, held
one experts module at a time; each expert's held-out output error below round to nearest's;
experts without tokens left rounded to nearest; the checkpoint served as before."""

import copy
import json

import pytest
import torch
from transformers import AutoModelForCausalLM

import fp8ptq
from fake_cuda import CUDA, fake_cuda
from fp8ptq.algorithms.gptq import experts as gptq_experts_mod
from fp8ptq.algorithms.gptq.experts import (
    ExpertHessians,
    ExpertRounding,
    expert_output_errors,
    gptq_experts,
)
from fp8ptq.calibrators.registry import weight_entry
from fp8ptq.config.recipe import Recipe
from fp8ptq.execution.in_memory import quantize_model, token_batches
from fp8ptq.execution.streaming import quantize_sequential
from fp8ptq.formats import get_format
from fp8ptq.formats.granularity import weight_granularity
from fp8ptq.formats.weight_quant import half_layout
from fp8ptq.model.experts import experts_info, find_experts
from fp8ptq.nn.quant_experts import QuantExperts, quantize_experts
from test_moe import _force_router
from tiny_models import invoke, tiny

E = 8
# 16 x 64 calibration tokens: each expert (top-2 of 8) gets ~256 rows for its 64 inputs
CALIB = torch.randint(0, 128, (16, 64), generator=torch.Generator().manual_seed(5))
HELD_OUT = torch.randint(0, 128, (16, 64), generator=torch.Generator().manual_seed(6))
GPTQ = dict(format="e4m3", calib_data="calib", batch_size=4)  # the default recipe with data
RTN = dict(GPTQ, weight_calib="max")


def experts_inputs(model, ids) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Each experts module's (hidden states, top-k indices) in one forward of ``ids``."""
    seen, handles = {}, []
    for name, module, _ in find_experts(model):
        def hook(_m, args, _kwargs, name=name):
            seen[name] = (args[0].detach().clone(), args[1].clone())
        handles.append(module.register_forward_pre_hook(hook, with_kwargs=True))
    with torch.no_grad():
        model(input_ids=ids)
    for h in handles:
        h.remove()
    return seen


def quantized(model, **recipe):
    result = quantize_model(model, Recipe(**recipe), list(token_batches(CALIB, 4)))
    return model, result


@pytest.mark.parametrize("arch,all_tokens", [
    ("mixtral", False), pytest.param("mixtral", True, marks=pytest.mark.slow),
    pytest.param("qwen3_moe", False, marks=pytest.mark.slow),
    pytest.param("qwen3_moe", True, marks=pytest.mark.slow)])
def test_gptq_lowers_every_experts_held_out_output_error(arch, all_tokens):
    """Against round to nearest with the same scales, on held-out tokens the float model
    routes: with routed Hessians (the default) every expert's own output error is lower; with
    every token's (``gptq_all_experts``, another input distribution than the expert's own) the
    layer's summed error is (one Qwen3-MoE expert here is 1.6% above round to nearest).
    Weight-only, so that the error is the weights' alone, what GPTQ minimises (the default
    recipe's dynamic input rounding adds noise to both: docs/results/llm-compressor.md,
    "GPTQ for MoE experts", has both)."""
    float_model = tiny(arch)
    held = experts_inputs(float_model, HELD_OUT)
    floats = {n: copy.deepcopy(m) for n, m, _ in find_experts(float_model)}
    rtn, _ = quantized(copy.deepcopy(float_model), **RTN, act_format="none",
                       gptq_all_experts=all_tokens)
    gptq, result = quantized(copy.deepcopy(float_model), **GPTQ, act_format="none",
                             gptq_all_experts=all_tokens)
    for name, (x, idx) in held.items():
        facts = result.extras["experts"][name]["gptq"]
        assert facts["swept"] == {p: E for p in experts_info(floats[name]).projections}
        assert facts["rounded_to_nearest"] == []
        mine = expert_output_errors(floats[name], gptq.get_submodule(name), x, idx)
        theirs = expert_output_errors(floats[name], rtn.get_submodule(name), x, idx)
        assert set(mine) == set(theirs) == set(range(E))
        assert sum(mine.values()) < 0.95 * sum(theirs.values())
        if not all_tokens:
            assert all(mine[e] < theirs[e] for e in mine), (name, mine, theirs)


def test_hessians_per_expert_from_routed_rows_and_one_shared_for_every_token():
    x = torch.randn(12, 6)
    idx = torch.tensor([[0, 2]] * 5 + [[2, 3]] * 7)
    routed = ExpertHessians(4)
    gptq_experts_mod.observe_inputs(routed, (x, idx), {})
    assert routed.experts() == [0, 2, 3]  # expert 1 got no row: nothing allocated
    assert routed.peak_bytes == 3 * 6 * 6 * 8
    h2 = routed.take(2)
    assert torch.allclose(h2, 2 * x.double().T @ x.double() / 12)
    assert torch.allclose(routed.take(0), 2 * x[:5].double().T @ x[:5].double() / 5)
    assert routed.take(1) is None and routed.experts() == [3]  # taken sums are freed
    shared = ExpertHessians(4, shared=True, dtype=torch.float32)
    gptq_experts_mod.observe_inputs(shared, (x, idx), {})
    assert shared.experts() == [0, 1, 2, 3] and shared.nbytes == 6 * 6 * 4
    assert torch.allclose(shared.take(1), shared.take(3))
    diagonal = ExpertHessians(4, diagonal=True)  # hmse's: the input energies alone
    gptq_experts_mod.observe_inputs(diagonal, (x, idx), {})
    assert torch.allclose(diagonal.take(2), torch.diagonal(h2))
    assert diagonal.nbytes == 2 * 6 * 8


def _close(h: torch.Tensor, want: torch.Tensor) -> bool:
    """Equal to float32 products' rounding (relative to the largest entry)."""
    return float((h - want).abs().max()) <= 1e-5 * float(want.abs().max())


def test_sequential_expert_hessians_equal_what_the_quantized_model_feeds(monkeypatch):
    """Each expert's gate_up Hessian is summed from the inputs the final quantized model gives
    the experts (the blocks before quantized), its down Hessian from its own quantized
    gate_up's output."""
    taken = {}
    real = gptq_experts_mod.round_expert

    def spy(w2d, hessian, r, what, warnings):
        taken[(id(w2d.untyped_storage()), what)] = hessian.clone()
        return real(w2d, hessian, r, what, warnings)

    monkeypatch.setattr(gptq_experts_mod, "round_expert", spy)
    model, _ = quantized(tiny("qwen3_moe"), **GPTQ, gptq_all_experts=False)
    by_what = {}
    for (_, what), h in taken.items():
        by_what.setdefault(what, []).append(h)
    feeds = {n: [] for n, m in model.named_modules() if isinstance(m, QuantExperts)}
    for n in feeds:
        model.get_submodule(n).register_forward_pre_hook(
            lambda _m, a, _k, n=n: feeds[n].append((a[0].clone(), a[1].clone())),
            with_kwargs=True)
    with torch.no_grad():
        for b in token_batches(CALIB, 4):
            model(**b)
    layer = sorted(feeds)[1]  # block 1: its inputs come through the quantized block 0
    q = model.get_submodule(layer)
    x = torch.cat([a for a, _ in feeds[layer]])
    idx = torch.cat([i for _, i in feeds[layer]])
    for e in (0, 5):
        xe = x[(idx == e).any(-1)].double()
        want = 2 * xe.T @ xe / xe.shape[0]
        assert any(_close(h, want) for h in by_what[f"expert {e} gate_up_proj weight"]), e
        mid = q.inner.act_fn(q._gemm("gate_up_proj", e, xe.float()).chunk(2, -1)[0]) \
            * q._gemm("gate_up_proj", e, xe.float()).chunk(2, -1)[1]
        want = 2 * mid.double().T @ mid.double() / mid.shape[0]
        assert any(_close(h, want) for h in by_what[f"expert {e} down_proj weight"]), e


def test_expert_without_tokens_keeps_round_to_nearest():
    gptq_model = tiny("mixtral")
    rtn_model = copy.deepcopy(gptq_model)
    for m in (gptq_model, rtn_model):
        _force_router(m, [0, 1, 2])
    _, result = quantized(gptq_model, **GPTQ, gptq_all_experts=False)
    quantized(rtn_model, **RTN, gptq_all_experts=False)
    name = "model.layers.0.mlp.experts"
    facts = result.extras["experts"][name]["gptq"]
    assert facts["rounded_to_nearest"] == [3, 4, 5, 6, 7]
    assert facts["swept"] == {"gate_up_proj": 3, "down_proj": 3}
    assert facts["max_hessian_bytes"] == 3 * 64 * 64 * 8  # three experts' gate_up sums
    assert any("expert(s) [3, 4, 5, 6, 7] received no calibration token" in w
               for w in result.warnings)
    mine, theirs = gptq_model.get_submodule(name), rtn_model.get_submodule(name)
    for proj in mine.info.projections:
        assert torch.equal(mine.codes(proj)[3:], theirs.codes(proj)[3:])
        assert not torch.equal(mine.codes(proj)[:3], theirs.codes(proj)[:3])


def test_one_pass_gptq_rounds_experts_to_nearest_and_says_so():
    _, result = quantized(tiny("qwen3_moe"), **GPTQ, gptq_sequential=False)
    assert "gptq" not in result.extras["experts"]["model.layers.0.mlp.experts"]
    assert any("GPTQ sweeps fused MoE experts only in sequential GPTQ" in w
               for w in result.warnings)


@pytest.mark.parametrize("all_tokens", [True, False])
def test_expert_gptq_stays_on_the_weights_gpu(monkeypatch, all_tokens):
    """The sums, the sweeps and the fused codes of a CUDA experts module stay on its device.
    Routed rows are picked by a boolean mask (a host sync the fake device refuses), so there
    every expert is handed all rows by index instead."""
    if not all_tokens:
        monkeypatch.setattr(gptq_experts_mod, "_rows_by_expert", lambda idx, num, _all: [
            (e, torch.arange(idx.shape[0], device=idx.device)) for e in range(num)])
    module = tiny("qwen3_moe").get_submodule("model.layers.0.mlp.experts")
    info = experts_info(module)
    fmt = get_format("e4m3")
    half_layout(fmt)  # the format's tables built from real values, before the fake mode
    gran = weight_granularity("channel")
    r = ExpertRounding(fmt, gran, weight_entry("gptq").build(), all_tokens=all_tokens)
    made, devices = {}, set()
    real_add = ExpertHessians.add

    def add(self, expert, x):
        real_add(self, expert, x)
        devices.update(s.device.type for s in self.sums.values())

    def build(round_first):
        q, _ = quantize_experts("experts", module, info, weight_format=fmt, act_format=fmt,
                                act_granularity="token", gran=gran, w_calib=r.w_calib,
                                a_calib=None, stats={}, round_expert=round_first)
        made["q"] = q
        return q

    with fake_cuda():
        module.to(CUDA)
        x = torch.randn(16, 64, device=CUDA)
        idx = torch.zeros(16, 2, dtype=torch.long, device=CUDA)

        def feed(target, observe):
            observe((x, idx, torch.ones(16, 2, device=CUDA)), {})

        ExpertHessians.add = add
        try:
            facts = gptq_experts(module, info, feed, build, r)
        finally:
            ExpertHessians.add = real_add
    q = made["q"]
    assert devices == {"cuda"}
    assert facts["swept"] == {"gate_up_proj": E, "down_proj": E}
    assert all(q.codes(p).device == CUDA and q.weight_scale(p).device == CUDA
               for p in info.projections)


@pytest.mark.slow
def test_cli_default_recipe_checkpoint_validates_and_transformers_loads(tmp_path,
                                                                       word_tokenizer):
    model_dir = tmp_path / "qwen3moe"
    tiny("qwen3_moe").save_pretrained(model_dir)
    word_tokenizer.save_pretrained(model_dir)
    calib = tmp_path / "calib.txt"
    calib.write_text("\n".join(f"the quick brown fox {i} jumps over the lazy dog again"
                               for i in range(40)) + "\n")
    out = tmp_path / "out"
    res = invoke(["quantize", str(model_dir), "-o", str(out), "--calib-data", str(calib),
                  "--num-samples", "8", "--seq-len", "16", "--batch-size", "4", "--json"])
    assert res.exit_code == 0, (res.output, res.exception)
    report = json.loads(res.stdout)
    for facts in report["experts"].values():  # few tokens: an expert may get none
        gptq = facts["gptq"]
        assert gptq["swept"]["down_proj"] + len(gptq["rounded_to_nearest"]) == E
        assert gptq["swept"]["down_proj"] >= E // 2
    res = invoke(["validate", str(out)])
    assert res.exit_code == 0, res.output
    ours = fp8ptq.load(out).model
    hf = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    q = ours.get_submodule("model.layers.1.mlp.experts")
    fused = hf.get_submodule("model.layers.1.mlp.experts")
    for proj in q.info.projections:
        mine = torch.stack([q.dequantized_weight(proj, e) for e in range(E)])
        assert torch.equal(getattr(fused, proj).detach().float(), mine)


@pytest.mark.slow
def test_block_by_block_run_sweeps_the_experts_as_in_memory(tmp_path):
    """``--sequential`` (one block loaded at a time, the quantized block's outputs propagated)
    sweeps each block's experts where the block runs them, as the in-memory run does."""
    tiny("qwen3_moe").save_pretrained(tmp_path / "src")
    recipe = Recipe(**GPTQ, dtype="float32")
    ref = AutoModelForCausalLM.from_pretrained(tmp_path / "src", dtype=torch.float32).eval()
    ref_result = quantize_model(ref, recipe, list(token_batches(CALIB, 4)))
    result, _ = quantize_sequential(tmp_path / "src", recipe, list(token_batches(CALIB, 4)),
                                    propagate="quantized")
    for name, facts in ref_result.extras["experts"].items():
        assert result.extras["experts"][name]["gptq"]["swept"] == facts["gptq"]["swept"]
        mine, theirs = result.model.get_submodule(name), ref.get_submodule(name)
        for proj in mine.info.projections:
            same = (mine.codes(proj) == theirs.codes(proj)).float().mean()
            assert same > 0.99, (name, proj, float(same))


@pytest.mark.slow
@pytest.mark.parametrize("extra", [dict(weight_calib="hmse"), dict(weight_calib="gptq-hmse"),
                                   dict(weight_calib="gptq-mse"), dict(gptq_asym=True),
                                   dict(act_granularity="tensor")])
def test_every_hessian_calibrator_sweeps_the_experts(extra):
    """Hessian-weighted scales (rounded to nearest or swept), MSE scales, asymmetric GPTQ and
    static inputs: every expert of Qwen2-MoE (shared expert beside the routed ones) is
    quantized with its own Hessians, its codes differing from round to nearest's."""
    model = tiny("qwen2_moe")
    rtn = copy.deepcopy(model)
    _, result = quantized(model, **{**GPTQ, **extra})
    quantized(rtn, **{**RTN, **{k: v for k, v in extra.items() if k == "act_granularity"}})
    for name, facts in result.extras["experts"].items():
        assert facts["gptq"]["swept"] == {"gate_up_proj": E, "down_proj": E}
        mine, theirs = model.get_submodule(name), rtn.get_submodule(name)
        for proj in mine.info.projections:
            assert bool(torch.isfinite(mine.weight_scale(proj)).all())
            assert not torch.equal(mine.codes(proj), theirs.codes(proj))

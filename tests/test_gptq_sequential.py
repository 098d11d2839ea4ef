"""Sequential GPTQ (``fp8ptq.algorithms.gptq.sequential``): every Hessian is the one the FINAL
quantized
model gives that GEMM on the calibration batches (the errors of the GEMMs before it included),
the first group's equals one-pass GPTQ bit for bit, GPTQ's output error on those rows is never
above round-to-nearest's, and GEMMs outside the blocks keep the one-pass Hessian."""

import json
from collections import Counter

import pytest
import torch

from fp8ptq.algorithms.gptq.sweep import gptq_codes
from fp8ptq.config.recipe import Recipe
from fp8ptq.execution import in_memory
from fp8ptq.execution.in_memory import quantize_model, token_batches
from fp8ptq.formats import decode, encode
from fp8ptq.model.forward import run_batch
from fp8ptq.nn.quant_gemm import QuantGemm
from fp8ptq.observe.hessian import HessianCollector
from tiny_models import IDS, invoke, saved_llama_with_calib, tiny

BATCHES = list(token_batches(IDS, 4))
QUANTIZE_TARGET = in_memory.quantize_target


def recorded_run(monkeypatch, model, recipe):
    """Quantize ``model``; returns (result, {name: Hessian handed to quantize_target})."""
    seen = {}
    def spy(model_, t, *args, hessian=None, **kwargs):
        seen[t.name] = hessian
        return QUANTIZE_TARGET(model_, t, *args, hessian=hessian, **kwargs)

    monkeypatch.setattr(in_memory, "quantize_target", spy)
    return quantize_model(model, recipe, BATCHES), seen


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["llama", "gpt2", "bert"])
def test_each_hessian_is_what_the_quantized_model_feeds_that_gemm(monkeypatch, arch):
    # plain sequential GPTQ (sink-aware GPTQ adds the first tokens: tests/test_gptq_sink.py)
    recipe = Recipe(format="e4m3", act_granularity="token", weight_calib="gptq",
                    dtype="float32", gptq_sink=0)
    model = tiny(arch).float()
    result, seen = recorded_run(monkeypatch, model, recipe)
    facts = result.extras["gptq"]["sequential"]
    assert facts["blocks"] == 2
    assert facts["outside"] == (["qa_outputs"] if arch == "bert" else [])  # one-pass H
    quantized = {n: m for n, m in model.named_modules() if isinstance(m, QuantGemm)}
    assert set(quantized) == set(seen) and all(h is not None for h in seen.values())
    after = HessianCollector(quantized)
    with after.observing(), torch.inference_mode():
        for b in BATCHES:
            run_batch(model, b)
    for name, h in seen.items():
        if name not in facts["outside"]:
            torch.testing.assert_close(h, after.hessian(name), rtol=1e-6, atol=1e-9)
    # the one-pass Hessians (float model) differ after the first GEMM group
    float_model = tiny(arch).float()
    _, one_pass = recorded_run(monkeypatch, float_model,
                               recipe.merged(gptq_sequential=False))
    first = next(iter(seen))
    assert torch.equal(seen[first], one_pass[first])
    same = [n for n in seen if torch.equal(seen[n], one_pass[n])]
    # the first group (q/k/v share their input) and what is outside the blocks
    assert first in same and len(same) <= 3 + len(facts["outside"])


@pytest.mark.slow
def test_first_group_codes_equal_one_pass_and_later_ones_differ():
    recipe = Recipe(format="e4m3", act_format="none", weight_calib="gptq", dtype="float32",
                    gptq_sink=0)
    seq, one = tiny("llama").float(), tiny("llama").float()
    quantize_model(seq, recipe, BATCHES)
    quantize_model(one, recipe.merged(gptq_sequential=False), BATCHES)
    layers = seq.model.layers, one.model.layers
    for proj in ("q_proj", "k_proj", "v_proj"):
        a, b = (getattr(layer[0].self_attn, proj).weight_codes for layer in layers)
        assert torch.equal(a, b)
    assert not torch.equal(layers[0][1].mlp.down_proj.weight_codes,
                           layers[1][1].mlp.down_proj.weight_codes)


def test_gptq_beats_round_to_nearest_on_its_own_sequential_rows(monkeypatch):
    """The GPTQ property on the rows each GEMM sees in sequential mode: the output error
    tr((W - Q) H (W - Q)^T) of GPTQ's codes is <= that of rounding to nearest at the same
    scales, for every GEMM."""
    recipe = Recipe(format="hif8", act_format="none", weight_calib="gptq", dtype="float32")
    ref = tiny("llama").float()
    model = tiny("llama").float()
    _, seen = recorded_run(monkeypatch, model, recipe)
    for name, h in seen.items():
        q = model.get_submodule(name)
        w = ref.get_submodule(name).weight.detach().double()
        s = q.weight_granularity.expand(q.weight_scale, w).double()
        gq = decode(q.weight_codes, q.weight_format).double() * s
        rtn = decode(encode((w / s).float(), q.weight_format), q.weight_format).double() * s

        def err(wq, h=h, w=w):
            d = w - wq
            return float(torch.einsum("oi,ij,oj->", d, h.double(), d))

        assert err(gq) <= err(rtn) * 1.0001, name


@pytest.mark.slow
def test_lm_head_outside_the_blocks_keeps_the_one_pass_hessian(monkeypatch):
    recipe = Recipe(format="e4m3", act_format="none", weight_calib="gptq", dtype="float32",
                    quantize_lm_head=True)
    model = tiny("llama", tie_word_embeddings=False).float()
    result, seen = recorded_run(monkeypatch, model, recipe)
    assert result.extras["gptq"]["sequential"]["outside"] == ["lm_head"]
    assert seen["lm_head"] is not None and not result.modules[-1].warnings
    float_model = tiny("llama", tie_word_embeddings=False).float()
    want = HessianCollector({"lm_head": float_model.lm_head})
    with want.observing(), torch.inference_mode():
        for b in BATCHES:
            run_batch(float_model, b)
    torch.testing.assert_close(seen["lm_head"], want.hessian("lm_head"))
    codes = gptq_codes(float_model.lm_head.weight.detach(), want.hessian("lm_head"),
                       model.lm_head.weight_granularity.expand(model.lm_head.weight_scale,
                                                               float_model.lm_head.weight),
                       model.lm_head.weight_format, act_order=recipe.gptq_act_order)
    assert torch.equal(codes, model.lm_head.weight_codes)


@pytest.mark.slow
def test_cli_flag_is_recorded(tmp_path, word_tokenizer):
    src, calib = saved_llama_with_calib(tmp_path, word_tokenizer)
    for flag, want in (("--no-gptq-sequential", False), ("--gptq-sequential", True)):
        out = tmp_path / flag
        r = invoke(["quantize", src, "-o", out, "--weight-calib", "gptq", flag,
                    "--act-granularity", "token", "--calib-data", calib, "--num-samples", 2,
                    "--seq-len", 8, "--dtype", "float32"])
        assert r.exit_code == 0, r.output
        doc = json.loads((out / "fp8ptq.json").read_text())
        assert doc["recipe"]["gptq_sequential"] is want


def test_run_order_comes_from_one_sequence():
    """The groups (GEMMs fed the same tensor, in call order) are found by a forward of the
    first sequence alone, and equal those of the whole batch; a target that sequence leaves
    unreached makes the whole batch run (and, unreached still, it comes last, alone)."""
    from types import SimpleNamespace

    from fp8ptq.algorithms.gptq.sequential import _groups_in_run_order, _run_order

    model = tiny("llama").float().eval()
    attn, mlp = model.model.layers[0].self_attn, model.model.layers[0].mlp
    targets = [SimpleNamespace(name=n, module=m) for n, m in [
        ("down", mlp.down_proj), ("q", attn.q_proj), ("k", attn.k_proj), ("v", attn.v_proj),
        ("o", attn.o_proj), ("gate", mlp.gate_proj), ("up", mlp.up_proj)]]
    rows = []
    handle = model.model.layers[0].register_forward_pre_hook(
        lambda _m, args: rows.append(args[0].shape[0]))
    try:
        groups = _groups_in_run_order(model, targets, BATCHES)
        assert rows == [1]  # one sequence of the 4-sequence batch
        whole, _ = _run_order(model, targets, BATCHES[0])
        assert [[t.name for t in g] for g in groups] == [[t.name for t in g] for g in whole] \
            == [["q", "k", "v"], ["o"], ["gate", "up"], ["down"]]
        rows.clear()
        lost = SimpleNamespace(name="lost", module=torch.nn.Linear(2, 2))
        groups = _groups_in_run_order(model, [lost, *targets], BATCHES)
        assert rows == [1, 4] and [t.name for t in groups[-1]] == ["lost"]
    finally:
        handle.remove()


@pytest.mark.slow
def test_partial_forwards_run_lean_and_change_no_bit(monkeypatch):
    """The per-group Hessian forwards run ``lean_forwards``' rotary / RMSNorm / MLP (the
    statistics pass's code), and the codes are bit for bit those of transformers' own code
    (``FP8PTQ_LEAN_FORWARDS=0``)."""
    from fp8ptq.algorithms.gptq import sequential
    from fp8ptq.model import lean

    recipe = Recipe(format="e4m3", act_granularity="token", weight_calib="gptq",
                    gptq_act_order=True, dtype="float32")
    entered = []
    original = lean.lean_forwards

    def counting(model, enabled=True):
        entered.append(type(model).__name__)
        return original(model, enabled)

    monkeypatch.setattr(sequential, "lean_forwards", counting)
    runs = {}
    for flag in ("1", "0"):
        monkeypatch.setenv("FP8PTQ_LEAN_FORWARDS", flag)
        model = tiny("llama").float()
        quantize_model(model, recipe, BATCHES)
        runs[flag] = {n: m.weight_codes for n, m in model.named_modules()
                      if isinstance(m, QuantGemm)}
    # 2 blocks x 4 GEMM groups (q/k/v, o, gate/up, down), twice
    assert entered.count("LlamaDecoderLayer") == 2 * 8
    assert runs["1"].keys() == runs["0"].keys() and len(runs["1"]) == 14
    for name, codes in runs["1"].items():
        assert torch.equal(codes, runs["0"][name]), name


@pytest.mark.slow
def replay_budget(monkeypatch, budget: int) -> None:
    """Sequential GPTQ's replay kept within ``budget`` bytes (0: every forward recomputes)."""
    from fp8ptq.algorithms.gptq import sequential
    from fp8ptq.algorithms.gptq.replay import PartialForwards

    monkeypatch.setattr(sequential, "PartialForwards",
                        lambda unit, _budget: PartialForwards(unit, budget))


@pytest.mark.parametrize("arch", ["llama", "gpt2", "bert"])
def test_replayed_partial_forwards_change_no_bit(monkeypatch, arch):
    """``fp8ptq.algorithms.gptq.replay``: the later groups' forwards replay what the previous
    forward finished (q/k/v outputs, then the whole attention), and every Hessian and code is
    bit for bit what recomputing gives (budget 0: nothing kept)."""
    recipe = Recipe(format="e4m3", act_granularity="token", weight_calib="gptq",
                    dtype="float32")
    runs = {}
    for budget in (1 << 30, 0):
        replay_budget(monkeypatch, budget)
        model = tiny(arch).float()
        result, seen = recorded_run(monkeypatch, model, recipe)
        codes = {n: m.weight_codes for n, m in model.named_modules()
                 if isinstance(m, QuantGemm)}
        runs[budget] = (result.extras["gptq"]["sequential"], seen, codes)
    (facts, seen, codes), (facts0, seen0, codes0) = runs[1 << 30], runs[0]
    assert facts0["replayed_outputs"] == 0
    assert facts["replayed_outputs"] >= 2 * facts["blocks"]  # qkv, attention
    assert seen.keys() == seen0.keys() and codes.keys() == codes0.keys()
    for name in seen:
        assert torch.equal(seen[name], seen0[name]), name
        assert torch.equal(codes[name], codes0[name]), name


class _Stop(Exception):
    pass


def _stop(*_args):
    raise _Stop


def _forward_to(model, module, batch) -> None:
    """One forward of ``batch`` through ``model``, stopped on entering ``module`` (what a
    sequential GPTQ group forward does)."""
    h = module.register_forward_pre_hook(_stop)
    try:
        with torch.inference_mode():
            run_batch(model, batch, logits=False)
    except _Stop:
        pass
    finally:
        h.remove()


def test_replay_skips_the_attention_in_the_down_projection_forward():
    """In a Llama block the down_proj group's forward runs no attention: ``self_attn`` returns
    the output recorded in the gate/up forward (counted by a hook on its q_proj, which would
    run if the attention did)."""
    from fp8ptq.algorithms.gptq.replay import PartialForwards

    model = tiny("llama").float().eval()
    block = model.model.layers[0]
    batch = {"input_ids": IDS[:2]}
    partial = PartialForwards(model, 1 << 30)
    q_calls = []
    block.self_attn.q_proj.register_forward_hook(lambda *a: q_calls.append(1))
    mlp = block.mlp

    partial.run(0, [mlp.gate_proj, mlp.up_proj],
                lambda: _forward_to(model, mlp.gate_proj, batch))
    assert q_calls == [1]
    assert any(n.endswith("layers.0.self_attn") for n in partial.kept[0])
    partial.run(0, [mlp.down_proj], lambda: _forward_to(model, mlp.down_proj, batch))
    assert q_calls == [1] and partial.replayed >= 1


def test_replay_records_what_a_later_forward_can_use_only():
    """Nothing is recorded where no forward follows (``record=False``: a unit's last group),
    and a ``QuantGemm``'s inner ``Linear`` is never recorded beside the wrapper."""
    from fp8ptq.algorithms.gptq.replay import PartialForwards

    model = tiny("llama").float().eval()
    quantize_model(model, Recipe(format="e4m3", act_format="none", dtype="float32"), BATCHES)
    partial = PartialForwards(model, 1 << 30)
    assert "model.layers.0.self_attn.q_proj" in partial.wanted
    assert "model.layers.0.self_attn.q_proj.inner" not in partial.wanted
    assert "model.layers.0.input_layernorm" not in partial.wanted  # no GEMM inside
    mlp = model.model.layers[0].mlp

    def to_down():
        _forward_to(model, mlp.down_proj, {"input_ids": IDS[:2]})

    partial.run(0, [mlp.down_proj], to_down, record=False)
    assert partial.kept == {}
    partial.run(0, [mlp.down_proj], to_down)
    assert set(partial.kept[0]) == {"model.layers.0.self_attn", "model.layers.0.mlp.gate_proj",
                                    "model.layers.0.mlp.up_proj"}


def test_next_block_inputs_replay_attention_and_gate_up(monkeypatch):
    """Block 0's attention is entered twice per batch: the q/k/v forward stops at its q_proj,
    the o_proj forward runs it to o_proj. The gate/up forward runs only o_proj, on the input
    the o_proj forward stopped on (the attention's tail GEMM), the down_proj forward replays
    the attention's output, and the forward that makes block 1's inputs runs only down_proj
    (the MLP's tail) on its recorded input. Recomputing enters it five times per batch, plus
    once in the forward that finds the groups; bit for bit the same codes either way
    (``test_replayed_partial_forwards_change_no_bit``)."""
    recipe = Recipe(format="e4m3", act_granularity="token", weight_calib="gptq",
                    dtype="float32")
    counts = {}
    for budget in (1 << 30, 0):
        replay_budget(monkeypatch, budget)
        model = tiny("llama").float()
        attn = model.model.layers[0].self_attn
        runs = []
        cls_forward = type(attn).forward

        def counting(self, *args, _f=cls_forward, _attn=attn, _runs=runs, **kwargs):
            if self is _attn:
                _runs.append(1)
            return _f(self, *args, **kwargs)

        monkeypatch.setattr(type(attn), "forward", counting)
        quantize_model(model, recipe, BATCHES)
        monkeypatch.setattr(type(attn), "forward", cls_forward)
        counts[budget] = len(runs)
    assert counts[1 << 30] == 2 * len(BATCHES) + 1, counts
    assert counts[0] == 5 * len(BATCHES) + 1, counts


@pytest.mark.parametrize("arch", ["llama", "gpt2", "bert"])
def test_tails_are_the_modules_that_return_a_gemms_own_output(arch):
    """``PartialForwards.probe`` finds the modules whose output is the very tensor their last
    GEMM returned: a Llama block's attention (``o_proj``, beside its weights' None) and MLP
    (``down_proj``); GPT-2's attention and MLP end in a dropout and BERT's in a residual
    LayerNorm, so neither has one (their replays stay the plain ones)."""
    from fp8ptq.algorithms.gptq.replay import PartialForwards

    model = tiny(arch).float().eval()
    partial = PartialForwards(model, 1 << 30)
    with partial.probe(), torch.inference_mode():
        run_batch(model, {"input_ids": IDS[:2]}, logits=False)
    layers = len(model.model.layers) if arch == "llama" else 0
    want = {f"model.layers.{i}.{m}": t for i in range(layers)
            for m, t in (("self_attn", ("o_proj", 2)), ("mlp", ("down_proj", 0)))}
    assert partial.tails == want


@pytest.mark.parametrize("arch", ["llama", "bert"])
def test_each_gemm_of_a_block_runs_once_per_batch(arch):
    """A group's forward stops on entering its FIRST member: the members are fed one input
    tensor, so its pre-hook collects for all of them. Stopped at the last member it had first
    run q and k (before v) and gate (before up) once more per batch for nothing; now every GEMM
    of a block that is followed by another runs the same number of times (in a Llama block the
    run-order probe, then one forward per batch), and the Hessians stay the quantized model's
    (``test_each_hessian_is_what_the_quantized_model_feeds_that_gemm``)."""
    model = tiny(arch).float()
    calls = Counter()
    for name, m in model.named_modules():
        if isinstance(m, torch.nn.Linear) and ".0." in name and "layer" in name:
            m.register_forward_hook(lambda *_a, n=name: calls.update([n]))
    recipe = Recipe(format="e4m3", act_granularity="token", weight_calib="gptq",
                    dtype="float32")
    quantize_model(model, recipe, BATCHES)
    assert len(calls) >= 6 and len(set(calls.values())) == 1, calls
    if arch == "llama":  # all of a Llama block's later forwards replay: one per batch
        assert set(calls.values()) == {1 + len(BATCHES)}, calls

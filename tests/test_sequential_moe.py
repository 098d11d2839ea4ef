"""Sequential mode on Mixture-of-Experts models: transformers 5 saves the routed experts per
expert (``mlp.experts.3.gate_proj.weight``) and merges them into fused 3-D parameters at load
through its conversion mapping; the block loader applies the same mapping per block, so each
block's experts are quantized with ``QuantExperts`` exactly as in the in-memory pipeline."""

import json

import pytest
import torch
from transformers import AutoModelForCausalLM

import fp8ptq
from fp8ptq.checkpoint import save_quantized
from fp8ptq.config.recipe import Recipe
from fp8ptq.execution.in_memory import quantize_model
from fp8ptq.execution.streaming import quantize_sequential, write_sequential
from fp8ptq.nn.quant_experts import QuantExperts
from fp8ptq.nn.quant_gemm import QuantGemm
from test_moe import batches, logits
from test_sequential import checkpoint_tensors
from tiny_models import tiny

pytestmark = pytest.mark.slow  # every test here runs over ~5 s (see pyproject.toml)


def quant_state(model):
    return {f"{n}.{b}": t for n, m in model.named_modules()
            if isinstance(m, (QuantGemm, QuantExperts))
            for b, t in m.named_buffers(recurse=False) if t is not None}


@pytest.mark.parametrize("arch", ["mixtral", "qwen2_moe", "qwen3_moe"])
def test_sequential_moe_is_bit_identical_and_reloads(arch, tmp_path):
    tiny(arch).save_pretrained(tmp_path / "src", max_shard_size="200KB")  # experts span files
    # the recipe vLLM's fused-MoE kernels serve: compressed-tensors with per-expert names
    recipe = Recipe(act_granularity="tensor",
                    dtype="float32", weight_granularity="tensor", batch_size=2)
    ref = AutoModelForCausalLM.from_pretrained(tmp_path / "src", dtype=torch.float32).eval()
    ref_result = quantize_model(ref, recipe, batches())
    result, loader = quantize_sequential(tmp_path / "src", recipe, batches(), propagate="fp")
    want, got = quant_state(ref), quant_state(result.model)
    assert any(".experts." in k for k in want) and set(want) == set(got)
    for name in want:
        assert torch.equal(want[name], got[name]), name
    assert loader.max_resident <= 2
    assert set(result.extras["experts"]) == {f"model.layers.{i}.mlp.experts" for i in (0, 1)}
    out = logits(result.model)
    assert torch.equal(out, logits(ref))

    # written block by block (each block freed once written): the in-memory checkpoint's
    # tensors bit for bit, reloaded by fp8ptq and transformers
    save_quantized(ref_result, recipe, tmp_path / "memory")
    _, facts = write_sequential(tmp_path / "src", recipe, batches(), tmp_path / "ck",
                                propagate="fp")
    assert facts["layout"] == "compressed-tensors"
    a, b = checkpoint_tensors(tmp_path / "memory"), checkpoint_tensors(tmp_path / "ck")
    assert set(a) == set(b)
    for k in a:
        assert torch.equal(a[k], b[k]), k
    meta = json.loads((tmp_path / "ck" / "fp8ptq.json").read_text())
    assert set(meta["experts"]) == set(result.extras["experts"])
    assert torch.equal(logits(fp8ptq.load(tmp_path / "ck").model), out)
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "ck")  # merges per-expert tensors
    q = result.model.get_submodule("model.layers.1.mlp.experts")
    fused = hf.get_submodule("model.layers.1.mlp.experts")
    for proj in q.info.projections:
        mine = torch.stack([q.dequantized_weight(proj, e) for e in range(q.num_experts)])
        assert torch.equal(getattr(fused, proj).detach().float(), mine)

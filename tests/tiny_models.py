"""Shared by the tests: tiny randomly initialised models of every architecture family we claim,
and the in-process CLI runner."""

import json

import torch
from click.testing import CliRunner
from transformers import (
    BertConfig,
    BertForQuestionAnswering,
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    MixtralConfig,
    MixtralForCausalLM,
    OPTConfig,
    OPTForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen2MoeConfig,
    Qwen2MoeForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)

from fp8ptq.cli.main import main

VOCAB = 128
# The recipe before the default became FP8_DYNAMIC + GPTQ: channel weights rounded to nearest,
# static per-tensor activation scales. Tests of static scales / calibration pin it explicitly.
STATIC = ["--act-granularity", "tensor", "--weight-calib", "max"]
STATIC_RECIPE = dict(act_granularity="tensor", weight_calib="max")
ARCHS = ("llama", "gpt2", "opt", "bert")

MOE = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
           num_key_value_heads=2, num_experts_per_tok=2)  # fused experts (transformers 5)

# family -> (config class, model class, config fields of the default tiny model)
FAMILIES = {
    "llama": (LlamaConfig, LlamaForCausalLM,
              dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                   intermediate_size=128)),
    "qwen2": (Qwen2Config, Qwen2ForCausalLM,
              dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=2, intermediate_size=128)),
    "gpt2": (GPT2Config, GPT2LMHeadModel,
             dict(vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4, bos_token_id=0,
                  eos_token_id=0)),
    "opt": (OPTConfig, OPTForCausalLM,
            dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                 ffn_dim=128, word_embed_proj_dim=64, bos_token_id=0, eos_token_id=0,
                 pad_token_id=1)),
    "mixtral": (MixtralConfig, MixtralForCausalLM,
                dict(MOE, intermediate_size=32, num_local_experts=8)),
    "qwen2_moe": (Qwen2MoeConfig, Qwen2MoeForCausalLM,
                  dict(MOE, intermediate_size=128, moe_intermediate_size=32,
                       shared_expert_intermediate_size=64, num_experts=8)),
    "qwen3_moe": (Qwen3MoeConfig, Qwen3MoeForCausalLM,
                  dict(MOE, intermediate_size=128, moe_intermediate_size=32, num_experts=8)),
    "bert": (BertConfig, BertForQuestionAnswering,
             dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                  intermediate_size=128)),
}


def tiny(arch: str, *, seed: int | None = 0, dtype=None, head=None, attn: str | None = None,
         **config):
    """A tiny randomly initialised ``arch`` model (a key of ``FAMILIES``) in eval mode.

    ``config``: config fields over the family's defaults; ``head``: another model class of the
    family (e.g. ``BertForMaskedLM``); ``seed``: torch's seed before the weights are drawn
    (None: the caller's random state); ``dtype``: built in that dtype (``_from_config``);
    ``attn``: the attention implementation."""
    config_cls, model_cls, defaults = FAMILIES[arch]
    cfg = config_cls(**{**defaults, **config})
    if attn is not None:
        cfg._attn_implementation = attn
    if seed is not None:
        torch.manual_seed(seed)
    cls = head or model_cls
    model = cls(cfg) if dtype is None else cls._from_config(cfg, dtype=dtype)
    return model.eval()


def run(model, ids):
    with torch.no_grad():
        out = model(input_ids=ids)
    return out.logits if hasattr(out, "logits") else out.start_logits


IDS = torch.randint(2, VOCAB, (8, 32), generator=torch.Generator().manual_seed(1))


def invoke(args, **kwargs):
    """``fp8ptq ARGS`` in this process through click's ``CliRunner`` (arguments made strings);
    ``kwargs`` go to ``CliRunner.invoke`` (``env=...``, ``input=...``)."""
    return CliRunner().invoke(main, [str(a) for a in args], **kwargs)


def saved_llama_with_calib(tmp_path, tokenizer):
    """(model folder, calibration text file): the tiny Llama saved with ``tokenizer`` (the
    ``word_tokenizer`` fixture) and a few lines of its words, for CLI quantize runs."""
    src = tmp_path / "src"
    tiny("llama").save_pretrained(src)
    tokenizer.save_pretrained(src)
    calib = tmp_path / "calib.txt"
    calib.write_text("the quick brown fox jumps over the lazy dog hello world again\n" * 8)
    return src, calib


# short CLI calibration of the KV-cache / FP8-attention tests (max weights, float32)
KV_CALIB = ["--num-samples", "4", "--seq-len", "16", "--batch-size", "2", "--weight-calib",
            "max", "--dtype", "float32"]


def gqa_source(root, tokenizer, kv_heads: int):
    """``root`` holding a tiny grouped-query Llama (``kv_heads`` KV heads for 4 query heads)
    saved with ``tokenizer`` under ``gqa`` and calibration text in ``calib.txt``."""
    tiny("llama", num_key_value_heads=kv_heads).save_pretrained(root / "gqa")
    tokenizer.save_pretrained(root / "gqa")
    (root / "calib.txt").write_text("the quick brown fox jumps over the lazy dog\n"
                                    "hello world and hello again a small model reads\n" * 20)
    return root


def quantize_per_granularity(src, *flags: str) -> dict:
    """``{granularity: folder}``: ``gqa_source``'s model quantized with ``flags`` and
    ``--kv-granularity tensor`` / ``head`` into ``src / granularity``."""
    out = {}
    for g in ("tensor", "head"):
        res = invoke(["quantize", src / "gqa", "-o", src / g, "--calib-data", src / "calib.txt",
                      *KV_CALIB, *flags, "--kv-granularity", g])
        assert res.exit_code == 0, res.output
        out[g] = src / g
    return out


def word_documents(path, count: int, words: int = 40, seed: int = 0) -> None:
    """``count`` seeded documents of ``words`` random words (the word tokenizer's vocabulary),
    one per line, written to ``path``: calibration text whose every 10th document
    ``--target-delta`` holds out."""
    vocab = "the quick brown fox jumps over the lazy dog a small model reads".split()
    g = torch.Generator().manual_seed(seed)
    docs = [" ".join(vocab[i] for i in torch.randint(0, len(vocab), (words,), generator=g).tolist())
            for _ in range(count)]
    path.write_text("\n".join(docs) + "\n")


def saved_with_documents(root, model, tokenizer, count: int):
    """``model`` and ``tokenizer`` saved under ``root / "llama"`` beside ``count`` word
    documents in ``root / "calib.txt"`` (``word_documents``); returns ``root``."""
    model.save_pretrained(root / "llama")
    tokenizer.save_pretrained(root / "llama")
    word_documents(root / "calib.txt", count)
    return root


def target_delta_report(root, out, *flags: str) -> dict:
    """``fp8ptq quantize`` of ``saved_with_documents``' model on its documents (4 x 32 tokens,
    float32, ``--target-tokens 128``) with ``flags`` (the ``--target-*`` ones), into ``out``;
    returns the ``--json`` report's ``target_delta``."""
    res = CliRunner().invoke(main, [
        "quantize", str(root / "llama"), "-o", str(out), "--calib-data", str(root / "calib.txt"),
        "--num-samples", "4", "--seq-len", "32", "--dtype", "float32", "--target-tokens", "128",
        *flags, "--json"])
    assert res.exit_code == 0, res.output
    return json.loads(res.stdout)["target_delta"]

"""Tiny randomly initialised models of every architecture family we claim (shared by tests)."""

import torch
from transformers import (
    BertConfig,
    BertForQuestionAnswering,
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    OPTConfig,
    OPTForCausalLM,
)

VOCAB = 128
ARCHS = ("llama", "gpt2", "opt", "bert")


def tiny(arch: str):
    torch.manual_seed(0)
    if arch == "llama":
        cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2,
                          num_attention_heads=4, intermediate_size=128)
        return LlamaForCausalLM(cfg).eval()
    if arch == "gpt2":
        cfg = GPT2Config(vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4, bos_token_id=0,
                         eos_token_id=0)
        return GPT2LMHeadModel(cfg).eval()
    if arch == "opt":
        cfg = OPTConfig(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2,
                        num_attention_heads=4, ffn_dim=128, word_embed_proj_dim=64,
                        bos_token_id=0, eos_token_id=0, pad_token_id=1)
        return OPTForCausalLM(cfg).eval()
    cfg = BertConfig(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2,
                     num_attention_heads=4, intermediate_size=128)
    return BertForQuestionAnswering(cfg).eval()


def run(model, ids):
    with torch.no_grad():
        out = model(input_ids=ids)
    return out.logits if hasattr(out, "logits") else out.start_logits


IDS = torch.randint(2, VOCAB, (8, 32), generator=torch.Generator().manual_seed(1))

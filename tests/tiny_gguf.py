"""Real GGUF files built in the tests: a tiny Llama, Qwen2-MoE and Qwen3-MoE, written with the
``gguf`` package the way llama.cpp's converter writes them (tensor names from gguf's own map,
Llama's q/k rows permuted for its rotary layout, matrices Q8_0-quantized, vectors float32) with
a byte-level BPE tokenizer, so transformers' GGUF loader and fp8ptq's streaming conversion read
them as they read a hub GGUF."""

from pathlib import Path

import gguf
import numpy as np
from transformers.convert_slow_tokenizer import bytes_to_unicode

from tiny_models import tiny

# every byte is a token (so any text tokenizes), one merge, then <s> and </s>
TOKENS = [bytes_to_unicode()[b] for b in range(256)] + ["th", "<s>", "</s>"]


def _permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's ``LlamaModel.permute`` (convert_hf_to_gguf.py): the q/k row order it stores."""
    return (w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:])
            .swapaxes(1, 2).reshape(w.shape))


def _header(path: Path, arch: str, cfg) -> gguf.GGUFWriter:
    """A writer for ``arch`` with the metadata llama.cpp's converter writes for ``cfg`` and the
    byte-level tokenizer."""
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name(f"tiny-{arch}")
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    w.add_rope_dimension_count(getattr(cfg, "head_dim", None)
                               or cfg.hidden_size // cfg.num_attention_heads)
    w.add_vocab_size(len(TOKENS))
    w.add_tokenizer_model("gpt2")
    w.add_token_list(TOKENS)
    w.add_token_types([1] * (len(TOKENS) - 2) + [3, 3])
    w.add_token_merges(["t h"])
    w.add_bos_token_id(len(TOKENS) - 2)
    w.add_eos_token_id(len(TOKENS) - 1)
    return w


def _add(w: gguf.GGUFWriter, name: str, a: np.ndarray) -> None:
    """Matrices (and stacked expert matrices) Q8_0, as llama.cpp's q8_0 output; vectors float32."""
    if a.ndim >= 2:
        q = gguf.quants.quantize(a, gguf.GGMLQuantizationType.Q8_0)
        w.add_tensor(name, q, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    else:
        w.add_tensor(name, a)


def _finish(w: gguf.GGUFWriter) -> None:
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def tiny_llama_gguf(path: Path, *, layers: int = 3, seed: int = 0, **config) -> Path:
    """Write a tiny Llama (hidden 64, GQA 4/2 heads, ``layers`` blocks, untied head) to
    ``path`` as GGUF; returns ``path``."""
    model = tiny("llama", seed=seed, vocab_size=len(TOKENS), num_hidden_layers=layers,
                 num_key_value_heads=2, tie_word_embeddings=False, **config)
    cfg = model.config
    w = _header(path, "llama", cfg)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, cfg.num_hidden_layers)
    for key, value in model.state_dict().items():
        base, suffix = key.rsplit(".", 1)
        a = value.float().numpy()
        if base.endswith("q_proj"):
            a = _permute(a, cfg.num_attention_heads)
        elif base.endswith("k_proj"):
            a = _permute(a, cfg.num_key_value_heads)
        _add(w, f"{names.get_name(base)}.{suffix}", a)
    _finish(w)
    return path


def tiny_qwen2moe_gguf(path: Path, *, layers: int = 2, seed: int = 0, moe_width: int = 1408,
                       shared_width: int = 5632, **kwargs) -> Path:
    """Write a tiny Qwen2-MoE (hidden 32, 4 experts, top-2, a gated shared expert) to ``path``
    the way llama.cpp stores one (``moe_gguf``). The expert widths default to Qwen2-MoE's
    config defaults (1408, shared 5632), the only ones transformers' GGUF loader gets right:
    it reads neither width from the file."""
    quantize = kwargs.pop("quantize", True)
    return moe_gguf(path, moe_model("qwen2_moe", layers=layers, seed=seed,
                                    moe_intermediate_size=moe_width,
                                    shared_expert_intermediate_size=shared_width, **kwargs),
                    quantize=quantize)


def tiny_qwen3moe_gguf(path: Path, *, layers: int = 2, seed: int = 0, moe_width: int = 48,
                       **kwargs) -> Path:
    """Write a tiny Qwen3-MoE (hidden 32, head_dim 16, q/k norms, 4 experts, top-2, no shared
    expert, normalized top-k weights as llama.cpp computes them) to ``path`` (``moe_gguf``)."""
    quantize = kwargs.pop("quantize", True)
    return moe_gguf(path, moe_model("qwen3_moe", layers=layers, seed=seed,
                                    moe_intermediate_size=moe_width, head_dim=16,
                                    norm_topk_prob=True, **kwargs), quantize=quantize)


# family -> (the GGUF architecture, gguf's tensor-name map of it)
MOE_ARCHS = {"qwen2_moe": ("qwen2moe", gguf.MODEL_ARCH.QWEN2MOE),
             "qwen3_moe": ("qwen3moe", gguf.MODEL_ARCH.QWEN3MOE)}


def moe_model(family: str, *, layers: int, seed: int, num_experts: int = 4, **config):
    """The tiny ``family`` MoE (a ``MOE_ARCHS`` key; hidden 32, the GGUF tokenizer's vocabulary)
    that ``moe_gguf`` writes."""
    return tiny(family, seed=seed, vocab_size=len(TOKENS), num_hidden_layers=layers,
                hidden_size=32, num_experts=num_experts, **config)


def moe_gguf(path: Path, model, *, quantize: bool = True) -> Path:
    """Write ``model`` (a ``moe_model``) to ``path`` the way llama.cpp stores one: expert count,
    used count and widths in the metadata, each block's experts stacked into
    ``ffn_{gate,up,down}_exps`` (transformers' fused ``gate_up_proj`` split back into its gate
    and up halves), a shared expert's gate a vector. ``quantize=False`` stores every tensor in
    float32, so the file holds the model's own weights bit for bit. Returns ``path``."""
    cfg = model.config
    arch, names_arch = MOE_ARCHS[cfg.model_type]
    w = _header(path, arch, cfg)
    w.add_expert_count(cfg.num_experts)
    w.add_expert_used_count(cfg.num_experts_per_tok)
    w.add_expert_feed_forward_length(cfg.moe_intermediate_size)
    if getattr(cfg, "shared_expert_intermediate_size", None):
        w.add_expert_shared_feed_forward_length(cfg.shared_expert_intermediate_size)
    if getattr(cfg, "head_dim", None):
        w.add_key_length(cfg.head_dim)
        w.add_value_length(cfg.head_dim)
    names = gguf.get_tensor_name_map(names_arch, cfg.num_hidden_layers)

    def add(name, a):
        _add(w, name, np.ascontiguousarray(a)) if quantize else w.add_tensor(
            name, np.ascontiguousarray(a, dtype=np.float32))

    for key, value in model.state_dict().items():
        a = value.float().numpy()
        if key.endswith("experts.gate_up_proj"):
            block = key.removesuffix(".gate_up_proj")
            gate, up = np.split(a, 2, axis=1)
            add(f"{names.get_name(block + '.gate_proj')}.weight", gate)
            add(f"{names.get_name(block + '.up_proj')}.weight", up)
        elif key.endswith("experts.down_proj"):
            add(f"{names.get_name(key)}.weight", a)
        else:
            base, suffix = key.rsplit(".", 1)
            if base.endswith("shared_expert_gate"):
                a = a[0]
            add(f"{names.get_name(base)}.{suffix}", a)
    _finish(w)
    return path

"""A real GGUF file built in the tests: a tiny Llama written with the ``gguf`` package the way
llama.cpp's converter writes one (tensor names from gguf's own map, q/k rows permuted for its
rotary layout, 2-D weights Q8_0-quantized, norms float32) with a byte-level BPE tokenizer, so
transformers' GGUF loader and fp8ptq's streaming conversion read it as they read a hub GGUF."""

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


def tiny_llama_gguf(path: Path, *, layers: int = 3, seed: int = 0, **config) -> Path:
    """Write a tiny Llama (hidden 64, GQA 4/2 heads, ``layers`` blocks, untied head) to
    ``path`` as GGUF; returns ``path``."""
    model = tiny("llama", seed=seed, vocab_size=len(TOKENS), num_hidden_layers=layers,
                 num_key_value_heads=2, tie_word_embeddings=False, **config)
    cfg = model.config
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name("tiny-llama")
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    w.add_rope_dimension_count(cfg.hidden_size // cfg.num_attention_heads)
    w.add_vocab_size(len(TOKENS))
    w.add_tokenizer_model("gpt2")
    w.add_token_list(TOKENS)
    w.add_token_types([1] * (len(TOKENS) - 2) + [3, 3])
    w.add_token_merges(["t h"])
    w.add_bos_token_id(len(TOKENS) - 2)
    w.add_eos_token_id(len(TOKENS) - 1)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, cfg.num_hidden_layers)
    for key, value in model.state_dict().items():
        base, suffix = key.rsplit(".", 1)
        a = value.float().numpy()
        if base.endswith("q_proj"):
            a = _permute(a, cfg.num_attention_heads)
        elif base.endswith("k_proj"):
            a = _permute(a, cfg.num_key_value_heads)
        name = f"{names.get_name(base)}.{suffix}"
        if a.ndim == 2:
            q = gguf.quants.quantize(a, gguf.GGMLQuantizationType.Q8_0)
            w.add_tensor(name, q, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
        else:
            w.add_tensor(name, a)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path

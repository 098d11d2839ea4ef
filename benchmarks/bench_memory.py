"""Peak RSS of quantization: sequential (block-by-block) vs in-memory, on a synthetic Llama.

The checkpoint (random bf16 weights) is generated once, streaming one layer per shard so that
generation never holds the model, into ``~/.cache/fp8ptq-bench/`` (never the repo, never CI).
Each mode runs in its own process; its peak RSS is read from ``getrusage``.

    python benchmarks/bench_memory.py --layers 16 --hidden 2048 --inter 5632   # ~1.9 GB bf16

The larger-than-RAM checkpoint (28.6 GB of bf16 on disk, 26.6 GiB: more than this 24 GB
machine's RAM, so it never fits the page cache either) is ONE shared folder, generated once
(13 min on the loaded 2-core box) and reused by every big-model measurement:

    ~/.cache/fp8ptq-bench/llama-l44-h5120-i13824-v32000     (45 shards: embeddings + one per layer)
    python benchmarks/bench_memory.py --layers 44 --hidden 5120 --inter 13824 --generate-only

``--only sequential --max-memory 4GB`` quantizes it as ``quantize --sequential --max-memory
4GB`` would (e4m3, channel weights, static per-tensor activations, 8 x 256 random tokens),
logging each block's calibration pass with the RSS then and the peak so far (stderr):

    python benchmarks/bench_memory.py --layers 44 --hidden 5120 --inter 13824 --only sequential \
        --max-memory 4GB

``--only model-free`` measures the model-free path against the read + write floor on it, and
``--only eval`` the peak RSS of ``fp8ptq eval`` on a 262,144-token-vocabulary model at context
2048 (target: model bytes + 2 GB).

Allocator: like ``fp8ptq quantize``, the quantize modes re-execute the bench with glibc's
huge-page tunable before importing torch (``fp8ptq.runtime.usage.exec_with_hugepages``; its child
processes inherit the environment), so the peaks are the command's; ``--only eval`` does not
(``fp8ptq eval`` keeps 4 KiB pages: huge pages raised its peak here).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path

from fp8ptq.runtime.usage import HUGEPAGE_COMMANDS, exec_with_hugepages


def _only(argv: list[str]) -> str | None:
    """``--only``'s value (either spelling), read before the re-exec and torch's import."""
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--only")
    return pre.parse_known_args(argv)[0].only


# the rows run ``fp8ptq quantize`` (huge pages) unless --only eval (``fp8ptq eval``: 4 KiB pages)
if _only(sys.argv[1:]) != "eval" and "quantize" in HUGEPAGE_COMMANDS:
    exec_with_hugepages()  # before torch is imported, as ``fp8ptq quantize`` does

import torch  # noqa: E402
from safetensors.torch import save_file  # noqa: E402
from transformers import LlamaConfig  # noqa: E402

CACHE = Path.home() / ".cache" / "fp8ptq-bench"
ASSETS = Path(__file__).resolve().parents[1].parent / "shared" / "assets"  # --assets
SMOLLM2 = "models/smollm2-135m/SmolLM2-135M-Instruct.Q4_1.gguf"
# e4m3 with static per-tensor activation scales and round-to-nearest channel weights: the
# issue's job (the CLI default, FP8_DYNAMIC + GPTQ, would take the model-free path or GPTQ)
STATIC = dict(act_granularity="tensor", weight_calib="max")
WIKI = "wikitext-2-raw/wiki.test.raw"


def generate(layers: int, hidden: int, inter: int, vocab: int = 32000) -> Path:
    folder = CACHE / f"llama-l{layers}-h{hidden}-i{inter}-v{vocab}"
    if (folder / "model.safetensors.index.json").is_file():
        return folder
    folder.mkdir(parents=True, exist_ok=True)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=inter,
                      num_hidden_layers=layers, num_attention_heads=max(1, hidden // 128),
                      num_key_value_heads=max(1, hidden // 128), architectures=["LlamaForCausalLM"])
    cfg.save_pretrained(folder)
    g = torch.Generator().manual_seed(0)

    def rnd(*shape):
        return (torch.randn(*shape, generator=g) * 0.02).to(torch.bfloat16)

    weight_map, total = {}, 0
    files = [{"model.embed_tokens.weight": None, "model.norm.weight": None,
              "lm_head.weight": None}]
    for i in range(layers):
        p = f"model.layers.{i}."
        files.append({p + "self_attn.q_proj.weight": (hidden, hidden),
                      p + "self_attn.k_proj.weight": (hidden, hidden),
                      p + "self_attn.v_proj.weight": (hidden, hidden),
                      p + "self_attn.o_proj.weight": (hidden, hidden),
                      p + "mlp.gate_proj.weight": (inter, hidden),
                      p + "mlp.up_proj.weight": (inter, hidden),
                      p + "mlp.down_proj.weight": (hidden, inter),
                      p + "input_layernorm.weight": "norm",
                      p + "post_attention_layernorm.weight": "norm"})
    n = len(files)
    for k, spec in enumerate(files):
        name = f"model-{k + 1:05d}-of-{n:05d}.safetensors"
        tensors = {}
        for t, shape in spec.items():
            if shape is None:
                tensors[t] = torch.ones(hidden, dtype=torch.bfloat16) if t.endswith(
                    "norm.weight") else rnd(vocab, hidden)
            elif shape == "norm":
                tensors[t] = torch.ones(hidden, dtype=torch.bfloat16)
            else:
                tensors[t] = rnd(*shape)
        save_file(tensors, folder / name, metadata={"format": "pt"})
        total += sum(v.numel() * 2 for v in tensors.values())
        weight_map.update({t: name for t in tensors})
        del tensors
    (folder / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": total}, "weight_map": weight_map}))
    return folder


def run_one(mode: str, folder: str, samples: int, seq: int, max_memory: str | None = None
            ) -> dict:
    """One quantize job in this process: e4m3, channel weights, static per-tensor activations
    (``STATIC``), bf16, calibrated on ``samples`` x ``seq`` random tokens. ``sequential`` goes
    through ``fp8ptq.execution.strategy`` as ``quantize --sequential --max-memory SIZE`` does
    (activation
    budget and output shard size from SIZE) and writes the checkpoint block by block; each
    block's end is logged to stderr with the RSS then and the peak so far."""
    from fp8ptq.config.recipe import Recipe
    from fp8ptq.execution.in_memory import quantize_model, token_batches
    from fp8ptq.execution.strategy import by_budget, parse_size
    from fp8ptq.execution.streaming import write_sequential

    recipe = Recipe(dtype="bfloat16", num_samples=samples, seq_len=seq, **STATIC)
    ids = torch.randint(10, 30000, (samples, seq), generator=torch.Generator().manual_seed(1))
    batches = list(token_batches(ids, recipe.batch_size))
    t0 = time.perf_counter()
    extra = {}
    if mode == "sequential":  # each block written as quantized, then freed (write_sequential)
        options = {}
        if max_memory:
            selection = by_budget(folder, recipe, parse_size(max_memory), forced_sequential=True)
            options = selection.sequential_options()
            extra = {"max_memory": max_memory, "route": selection.reason,
                     "estimate_gb": round(selection.estimate.sequential_fixed / 1e9, 2)}
        out = CACHE / "bench-memory-out"
        calls = [0]

        def progress():
            calls[0] += 1
            print(f"[{time.perf_counter() - t0:7.1f}s] calibration pass {calls[0]}: rss "
                  f"{_rss_mb('VmRSS'):.0f} MiB, peak {_rss_mb('VmHWM'):.0f} MiB",
                  file=sys.stderr, flush=True)

        try:
            _, sizes = write_sequential(folder, recipe, batches, out, force=True,
                                        progress=progress, **options)
        finally:
            shutil.rmtree(out, ignore_errors=True)
        source = sum(f.stat().st_size for f in Path(folder).glob("*.safetensors"))
        seconds = time.perf_counter() - t0
        extra.update(checkpoint_gb=round(sizes["checkpoint_bytes"] / 1e9, 2),
                     source_gb_per_s=round(source / 1e9 / seconds, 3))
    else:
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16).eval()
        quantize_model(model, recipe, batches)
    return {"mode": mode, "seconds": round(time.perf_counter() - t0, 1),
            "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
            **extra}


def _rss_mb(field: str) -> float:
    """``VmRSS`` (now) or ``VmHWM`` (peak) of this process, in MiB (Linux)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024
    return float("nan")


def copy_floor(folder: Path, out: Path) -> dict:
    """The floor of the model-free path: a plain read + write of the same files (64 MiB at a
    time, no computation), then ``sync`` so the bytes are on disk, as after the real run."""
    out.mkdir(parents=True)
    view = memoryview(bytearray(64 << 20))
    n, t0 = 0, time.perf_counter()
    for f in sorted(folder.iterdir()):
        with open(f, "rb", buffering=0) as src, open(out / f.name, "wb", buffering=0) as dst:
            while k := src.readinto(view):
                dst.write(view[:k])
                n += k
    os.sync()
    return _rate("floor: read + write", n, time.perf_counter() - t0)


def model_free(folder: Path, out: Path, act: str, workers: int) -> dict:
    """``quantize --model-free``: e4m3 channel weights, dynamic per-token or no activations."""
    from fp8ptq.config.recipe import Recipe
    from fp8ptq.execution.model_free_run import quantize_checkpoint

    recipe = Recipe(act_granularity="token") if act == "token" else Recipe(act_format="none")
    t0 = time.perf_counter()
    result, sizes = quantize_checkpoint(folder, recipe, out, workers=workers)
    os.sync()
    facts = result.extras["model_free"]
    row = _rate(f"model-free ({act})", facts["bytes_read"], time.perf_counter() - t0)
    row.update(written_gb=round(sizes["checkpoint_bytes"] / 1e9, 2),
               busy_s=facts["busy_seconds"], workers=workers)
    return row


def _rate(mode: str, nbytes: int, seconds: float) -> dict:
    return {"mode": mode, "seconds": round(seconds, 1), "read_gb": round(nbytes / 1e9, 2),
            "gb_per_s": round(nbytes / 1e9 / seconds, 3),
            "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)}


def bench_model_free(folder: Path, act: str, workers: int) -> None:
    """Floor and model-free, each in its own process, outputs deleted right after (disk is
    shared); the model is larger than RAM, so neither run finds it in the page cache."""
    rows = []
    for mode in ("floor", "model-free"):
        out = CACHE / f"out-{mode}"
        shutil.rmtree(out, ignore_errors=True)
        try:
            rows.append(_child([f"{mode}:{folder}", "--out", str(out), "--act", act,
                                "--workers", str(workers)]))
        finally:
            shutil.rmtree(out, ignore_errors=True)
        print(json.dumps(rows[-1]), flush=True)
    if all("gb_per_s" in r for r in rows):
        print(f"model-free throughput = {rows[1]['gb_per_s'] / rows[0]['gb_per_s']:.0%} of the "
              f"read + write floor ({rows[0]['gb_per_s']} GB/s)")


def big_vocab_model(assets: Path) -> Path:
    """A 262,144-token vocabulary on a small Llama (hidden 640, 18 layers: ~268M parameters,
    0.54 GB of bf16, tied embeddings - the shape of Gemma-3-270M), random weights, SmolLM2's
    tokenizer (its ids are all < 262,144). Generated once into the cache."""
    folder = CACHE / "llama-v262144-h640-l18"
    if (folder / "model.safetensors").is_file():
        return folder
    from transformers import AutoTokenizer, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=262144, hidden_size=640, intermediate_size=2048,
                      num_hidden_layers=18, num_attention_heads=4, num_key_value_heads=1,
                      max_position_embeddings=2048, tie_word_embeddings=True)
    # built beside the cache entry and renamed when complete: a run that fails half-way (no
    # tokenizer: a wrong --assets) leaves no folder that the next run would take as done
    tmp = folder.with_name(folder.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.rmtree(folder, ignore_errors=True)
    gguf = assets / SMOLLM2
    AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name).save_pretrained(tmp)
    LlamaForCausalLM(cfg).to(torch.bfloat16).save_pretrained(tmp)
    tmp.rename(folder)
    return folder


def bench_eval(limit: int, batch_size: int | None, assets: Path = ASSETS) -> dict:
    """``fp8ptq eval`` of the big-vocabulary model on WikiText at context 2048 (the batch size
    chosen from free memory unless given): its peak RSS (the command's own ``peak_rss_mb``)
    against the target model bytes + 2 GB."""
    folder = big_vocab_model(assets)
    model_bytes = (folder / "model.safetensors").stat().st_size
    out = CACHE / "eval-bench.json"
    cmd = [sys.executable, "-m", "fp8ptq.cli", "eval", str(folder), "--tasks", "wikitext",
           "--data", f"wikitext={assets / WIKI}", "--seq-len", "2048", "--limit", str(limit),
           "--json", str(out)] + (["--batch-size", str(batch_size)] if batch_size else [])
    res = subprocess.run(cmd, capture_output=True, text=True)
    if res.returncode:
        return {"mode": "eval", "failed": res.stderr.strip().splitlines()[-1:]}
    doc = json.loads(out.read_text())
    out.unlink()
    peak = doc["peak_rss_mb"] * 2**20
    return {"mode": "eval (vocab 262144, context 2048)", "model_gb": round(model_bytes / 1e9, 3),
            "peak_rss_gb": round(peak / 1e9, 3),
            "bound_gb": round((model_bytes + 2 * 2**30) / 1e9, 3),
            "within_bound": peak <= model_bytes + 2 * 2**30,
            "tokens": doc["protocol"].get("tokens") if isinstance(doc.get("protocol"), dict)
            else None, "seconds": doc["seconds"], "batch_size": batch_size or "auto"}


def _child(args: list[str]) -> dict:
    out = subprocess.run([sys.executable, __file__, "--child", *args], capture_output=True,
                         text=True)
    if out.returncode:
        return {"mode": args[0].split(":")[0], "failed": out.stderr.strip().splitlines()[-1:]}
    return json.loads(out.stdout.strip().splitlines()[-1])


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--inter", type=int, default=2816)
    ap.add_argument("--samples", type=int, default=8)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--max-memory", default=None,
                    help="sequential: plan as quantize --sequential --max-memory SIZE (4GB)")
    ap.add_argument("--only", choices=["sequential", "memory", "model-free", "eval"],
                    default=None)
    ap.add_argument("--limit", type=int, default=3, help="eval: WikiText articles")
    ap.add_argument("--assets", type=Path, default=ASSETS, help="the offline assets folder")
    ap.add_argument("--batch-size", type=int, default=None, help="eval [from free memory]")
    ap.add_argument("--act", choices=["token", "none"], default="token",
                    help="model-free: dynamic per-token e4m3 activations or weight-only")
    ap.add_argument("--workers", type=int, default=2, help="model-free compute threads")
    ap.add_argument("--out", default=None)
    ap.add_argument("--child", default=None)
    ap.add_argument("--generate-only", action="store_true", help="Only make the checkpoint.")
    a = ap.parse_args()
    if a.child:
        mode, folder = a.child.split(":", 1)
        if mode == "floor":
            print(json.dumps(copy_floor(Path(folder), Path(a.out))))
        elif mode == "model-free":
            print(json.dumps(model_free(Path(folder), Path(a.out), a.act, a.workers)))
        else:
            print(json.dumps(run_one(mode, folder, a.samples, a.seq, a.max_memory)))
        return
    if a.only == "eval":
        print(json.dumps(bench_eval(a.limit, a.batch_size, a.assets)))
        return
    folder = generate(a.layers, a.hidden, a.inter)
    size = sum(f.stat().st_size for f in folder.glob("*.safetensors"))
    print(f"model {folder.name}: {size / 2**30:.2f} GiB on disk; calib {a.samples}x{a.seq}")
    if a.generate_only:
        return
    if a.only == "model-free":
        bench_model_free(folder, a.act, a.workers)
        return
    for mode in ([a.only] if a.only else ["sequential", "memory"]):
        out = subprocess.run([sys.executable, __file__, "--child", f"{mode}:{folder}",
                              "--samples", str(a.samples), "--seq", str(a.seq)]
                             + (["--max-memory", a.max_memory] if a.max_memory else []),
                             stdout=subprocess.PIPE, text=True)  # stderr: the block log
        print(out.stdout.strip().splitlines()[-1] if out.returncode == 0 else
              f"{mode}: failed (exit {out.returncode}; its log is above)")


if __name__ == "__main__":
    main()

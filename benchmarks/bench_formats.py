"""Encode / decode / fake-quantize GB/s of every preset format on a 4096 x 4096 float32 tensor.

    python benchmarks/bench_formats.py [--size 4096] [--repeat 3] [--compile] [--json PATH]

``fake_quantize`` uses torch's float8 cast where the format has a torch dtype (e4m3, e5m2, FNUZ)
and the table-driven codec otherwise (hfp8, hif8, generic formats). ``--compile`` adds a
torch.compile'd fake-quant column (compile time excluded, reported separately).
"""

from __future__ import annotations

import argparse
import time

import torch
from _common import best_seconds, emit

from fp8ptq.formats import decode, encode, fake_quantize, get_format, preset_names


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", type=int, default=4096, help="square tensor edge")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--compile", action="store_true")
    ap.add_argument("--json")
    args = ap.parse_args()
    torch.manual_seed(0)
    x = torch.randn(args.size, args.size)
    gb = x.numel() * 4 / 1e9
    scale = torch.tensor(x.abs().max().item() / 400.0)
    rows = []
    for name in preset_names():
        spec = get_format(name)
        codes = encode(x / scale, spec)
        row = {
            "format": name,
            "encode GB/s": gb / best_seconds(lambda: encode(x / scale, spec), args.repeat),
            "decode GB/s": gb / best_seconds(lambda: decode(codes, spec), args.repeat),
            "fake-quant GB/s": gb / best_seconds(lambda: fake_quantize(x, scale, spec),
                                                 args.repeat),
        }
        if args.compile:
            fq = torch.compile(lambda t, s=scale, f=spec: fake_quantize(t, s, f))
            t0 = time.perf_counter()
            fq(x)
            row["compile s"] = time.perf_counter() - t0
            row["compiled fake-quant GB/s"] = gb / best_seconds(lambda: fq(x), args.repeat)
        rows.append(row)
    emit(f"format throughput, {args.size}x{args.size} float32, {torch.get_num_threads()} threads",
         rows, args.json, {"size": args.size, "threads": torch.get_num_threads()})


if __name__ == "__main__":
    main()

"""The cases ``test_gptq_fused.py`` checks, run in a child process under Triton's interpreter
(``TRITON_INTERPRET=1`` set by the parent before Triton is imported): for each, the torch column
loop's codes against the fused kernel's. Prints one JSON line: case name -> result."""

import json
import os

import torch

FORMATS = ["e4m3", "e5m2", "e4m3fnuz", "e5m2fnuz", "hfp8", "int8"]  # round half to even
LAYOUTS = ["tensor", "channel", "block"]
# a float64 column loop: float64 storage, and float32 storage (mixed)
PRECISIONS = {"float64": (torch.float64, torch.float64), "mixed": (torch.float32, torch.float64)}


def problem(out_features=48, in_features=200, seed=0):
    """A weight whose inputs are correlated and of uneven energy (act-order matters), widths
    that are neither whole 128-column blocks nor whole 32-row tiles (the kernel's masks)."""
    g = torch.Generator().manual_seed(seed)
    W = torch.randn(out_features, in_features, generator=g)
    mix = torch.randn(in_features, in_features, generator=g) / in_features ** 0.5
    X = (torch.randn(400, in_features, generator=g) @ (torch.eye(in_features) + mix)
         * torch.linspace(0.1, 3.0, in_features))
    return W, X.T @ X


def scales(W, fmt, layout):
    top = fmt.calibration_max
    if layout == "tensor":
        return (W.abs().amax() / top).expand_as(W)
    if layout == "channel":
        return (W.abs().amax(1, keepdim=True) / top).expand_as(W)
    blocks = W.abs().reshape(W.shape[0], -1, 40).amax(-1) / top  # 40-column groups
    return blocks.repeat_interleave(40, dim=1)


def both_ways(W, H, S, fmt, **kw):
    """(codes of the torch loop, codes of the sweep with the kernel, whether it took it)."""
    from fp8ptq.algorithms.gptq import sweep
    os.environ["FP8PTQ_GPTQ_TRITON"] = "0"
    loop = sweep.gptq_codes(W, H, S, fmt, **kw)
    os.environ["FP8PTQ_GPTQ_TRITON"] = "1"
    precision = sweep.Precision.of(kw.get("sweep_dtype", torch.float32))
    took = sweep.fused_block(fmt, {}, W.to(precision.storage), 128, precision.loop) is not None
    return loop, sweep.gptq_codes(W, H, S, fmt, **kw), took


def output_error(W, codes, S, H, fmt):
    from fp8ptq.formats import decode
    D = W - decode(codes, fmt) * S
    return float(torch.trace(D @ H @ D.T))


def main():
    from fp8ptq.formats import encode, get_format
    out = {}
    for name in FORMATS:
        fmt = get_format(name)
        W, H = problem()
        loop, kernel, took = both_ways(W, H, scales(W, fmt, "channel"), fmt, act_order=True)
        out[f"format/{name}"] = {"fused": took, "differ": int((loop != kernel).sum()),
                                 "distinct_codes": len(kernel.unique())}
    e4m3 = get_format("e4m3")
    for layout in LAYOUTS:
        for act_order in (False, True):
            W, H = problem(seed=1)
            loop, kernel, took = both_ways(W, H, scales(W, e4m3, layout), e4m3,
                                           act_order=act_order)
            out[f"layout/{layout}/{act_order}"] = {"fused": took,
                                                   "differ": int((loop != kernel).sum())}
    from fp8ptq.algorithms.gptq.sweep import Precision
    for label, precision in PRECISIONS.items():
        for name in ("e4m3", "e5m2", "int8"):
            fmt = get_format(name)
            W, H = problem(seed=3)
            loop, kernel, took = both_ways(W, H, scales(W, fmt, "block"), fmt, act_order=True,
                                           sweep_dtype=Precision(*precision))
            out[f"dtype/{label}/{name}"] = {"fused": took, "differ": int((loop != kernel).sum()),
                                            "codes": loop.numel()}
    W, H = problem(seed=2)
    S = scales(W, e4m3, "channel")
    _, kernel, _ = both_ways(W, H, S, e4m3)
    nearest = encode(W / S, e4m3)
    out["feedback"] = {"differ_from_nearest": int((kernel != nearest).sum()),
                       "error": output_error(W, kernel, S, H, e4m3),
                       "nearest_error": output_error(W, nearest, S, H, e4m3)}
    print(json.dumps(out))


if __name__ == "__main__":
    main()

#!/usr/bin/env bash
# The GPU check of one lent machine, one command: the GPU test tier, then bench_gpu.py's rows
# for models larger than the GPU, each row under its own time limit, every JSON under $OUT.
#   bash benchmarks/gpu_session.sh            on the CUDA machine (repo root; wheels carried in
#                                             .gpu/whl from ../shared/gpu-kit/fetch-wheels.sh,
#                                             llm-compressor's in .gpu/llmc if there)
#   bash benchmarks/gpu_session.sh --dry-run  the same rows on this CPU at small shapes (checks
#                                             the script and the rows' plumbing, not the GPU)
# Rows (their limits add up to about 12 of the 15 device minutes; a row cut short by its limit
# leaves what it measured in its JSON):
#   1. pytest -m gpu                                                          (150 s)
#   2. the 32-block 8B-shaped Llama: one block on the GPU, uncapped and capped at 6 GiB;
#      llm-compressor loaded on the CPU (sequential onloading) and on the GPU   (330 s)
#   3. a 70B-wide Llama (hidden 8192, intermediate 28672, 64 heads), 4 blocks, capped at 10 GiB
#      against uncapped                                                      (150 s)
#   4. a Qwen3-MoE-shaped model, one block at a time on the GPU               (90 s)
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/fp8ptq-gpu-out}; mkdir -p "$OUT"
DRY=0; [[ "${1:-}" == "--dry-run" ]] && DRY=1
if (( DRY )); then
    DEV=(--device cpu); L8=3; H8=(--hidden 256); L70=2; H70=(--hidden 512 --intermediate 1792 --heads 8)
    CAP6=1; CAP10=1; N=(--num-samples 8 --seq-len 64); LLMC=none
else
    if [[ -d .gpu/whl ]]; then
        python3 -m pip install -q --no-index --no-deps --target /tmp/site .gpu/whl/*.whl
        python3 -m pip install -q --no-index --no-deps --no-build-isolation --target /tmp/fp .
        export PYTHONPATH=/tmp/fp:/tmp/site
    fi
    DEV=(--device cuda); L8=32; H8=(); L70=4; H70=(--hidden 8192 --intermediate 28672 --heads 64)
    CAP6=6; CAP10=10; N=(--num-samples 128 --seq-len 512); LLMC=cpu,gpu
fi
LLMC_PATH=(); [[ -d .gpu/llmc ]] && LLMC_PATH=(--llmc-path "$PWD/.gpu/llmc:${PYTHONPATH:-}")
export PYTHONUNBUFFERED=1

row() {  # row NAME LIMIT_S ARGS...: one bench_gpu.py run, its JSON and log under $OUT
    local name=$1 limit=$2; shift 2
    echo "== $name (limit ${limit}s)"
    timeout "$limit" python3 benchmarks/bench_gpu.py "${DEV[@]}" --quantize-only \
        --json "$OUT/$name.json" "$@" 2>&1 | tee "$OUT/$name.log" | tail -25
    echo "== $name: exit ${PIPESTATUS[0]}"
}

if (( ! DRY )); then
    echo "== pytest -m gpu (limit 150s)"
    timeout 150 python3 -m pytest -q -m gpu -p no:cacheprovider 2>&1 | tee "$OUT/gpu-tier.log" \
        | tail -15
fi
row 8b-full-depth 330 --layers "$L8" "${H8[@]}" "${N[@]}" --recipes one-block --caps "$CAP6" \
    --llmc-modes "$LLMC" "${LLMC_PATH[@]}"
row 70b-wide 150 --layers "$L70" "${H70[@]}" "${N[@]}" --recipes one-block --caps "$CAP10" \
    --llmc-modes none
echo "== moe (limit 90s)"
timeout 90 python3 benchmarks/bench_moe_gpu.py "${DEV[@]}" --json "$OUT/moe.json" 2>&1 \
    | tee "$OUT/moe.log" | tail -15
ls -la "$OUT"

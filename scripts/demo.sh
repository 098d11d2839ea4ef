#!/usr/bin/env bash
# The main job on the offline demo model: install, quantize SmolLM2-135M to e4m3, then evaluate
# baseline (bf16) vs int8 vs that e4m3 checkpoint on a WikiText-2 test slice in one table.
# Extra arguments go to `fp8ptq eval` (e.g. --limit 4, --tasks wikitext,squad ...).
set -euo pipefail
cd "$(dirname "$0")/.."
ASSETS=${FP8PTQ_ASSETS:-../shared/assets}
MODEL=$ASSETS/models/smollm2-135m/SmolLM2-135M-Instruct.Q4_1.gguf
CALIB=$ASSETS/calib/wiki-paragraphs.txt
OUT=${FP8PTQ_OUT:-out}
python3 -m pip install -q -c constraints.txt -e .
fp8ptq quantize "$MODEL" --format e4m3 --calib-data "$CALIB" --output "$OUT/smollm2-e4m3" --force
fp8ptq eval "$MODEL" --tasks wikitext --data "wikitext=$ASSETS/wikitext-2-raw/wiki.test.raw" \
  --limit 2 --seq-len 2048 --compare "int8,$OUT/smollm2-e4m3" --calib-data "$CALIB" \
  --json "$OUT/smollm2-eval.json" --markdown "$OUT/smollm2-eval.md" "$@"

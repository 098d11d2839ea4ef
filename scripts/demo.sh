#!/usr/bin/env bash
# The main job on the offline demo model: install, quantize SmolLM2-135M to e4m3 and to int8 with
# the default recipe, then evaluate baseline (bf16) vs those two checkpoints on a WikiText-2 test
# slice in one table. The two quantize runs go side by side, one thread each (each spends part
# of its time in single-threaded GPTQ sweeps, so together they keep both cores busy; a GGUF not
# yet converted is converted by the first and read by the second); their reports go to
# $OUT/smollm2-FORMAT.quantize.json and their logs beside them.
# Extra arguments go to `fp8ptq eval` (e.g. --limit 4, --tasks wikitext,squad ...).
# FP8PTQ_QUANTIZE_THREADS: torch threads of each quantize run [1].
set -euo pipefail
cd "$(dirname "$0")/.."
ASSETS=${FP8PTQ_ASSETS:-../shared/assets}
MODEL=$ASSETS/models/smollm2-135m/SmolLM2-135M-Instruct.Q4_1.gguf
CALIB=$ASSETS/calib/wiki-paragraphs.txt
OUT=${FP8PTQ_OUT:-out}
mkdir -p "$OUT"
# set-up: pip's resolve alone is ~12 s of CPU even when nothing changed, so it runs only when
# `fp8ptq` does not import from this checkout or pyproject.toml / constraints.txt changed since
# the last install from here ($OUT/.installed). FP8PTQ_SKIP_INSTALL=1: never.
stamp=$(cat pyproject.toml constraints.txt | sha256sum | cut -c1-16)
installed() {
  [ "$(cat "$OUT/.installed" 2>/dev/null)" = "$stamp" ] && command -v fp8ptq > /dev/null &&
    python3 -c 'import importlib.util as u, os, sys
s = u.find_spec("fp8ptq")
sys.exit(not (s and os.path.samefile(s.origin, "fp8ptq/__init__.py")))' 2> /dev/null
}
if [ -z "${FP8PTQ_SKIP_INSTALL:-}" ] && ! installed; then
  python3 -m pip install -q -c constraints.txt -e .
  echo "$stamp" > "$OUT/.installed"
fi
trap 'kill $(jobs -p) 2>/dev/null || true' EXIT  # a failed run stops its sibling

quantize() {  # FORMAT: the default recipe into $OUT/smollm2-FORMAT; the log shown if it fails
  local name=$OUT/smollm2-$1
  # one thread each: side by side, two 2-thread processes would put 4 threads on the 2 cores,
  # and a descheduled OpenMP thread stalls its sibling at every barrier of a forward
  if ! OMP_NUM_THREADS=${FP8PTQ_QUANTIZE_THREADS:-1} fp8ptq quantize "$MODEL" --format "$1" \
      --calib-data "$CALIB" --output "$name" --force \
      --json > "$name.quantize.json" 2> "$name.quantize.log"; then
    cat "$name.quantize.log" >&2
    return 1
  fi
}

echo "quantizing SmolLM2-135M to e4m3 and int8 (default recipe; reports in $OUT/*.quantize.json)"
start=$SECONDS
quantize e4m3 & e4m3=$!
quantize int8 & int8=$!
wait "$e4m3"
wait "$int8"
echo "quantized in $((SECONDS - start)) s"
fp8ptq eval "$MODEL" --tasks wikitext --data "wikitext=$ASSETS/wikitext-2-raw/wiki.test.raw" \
  --limit 2 --seq-len 2048 --compare "$OUT/smollm2-int8,$OUT/smollm2-e4m3" \
  --json "$OUT/smollm2-eval.json" --markdown "$OUT/smollm2-eval.md" "$@"

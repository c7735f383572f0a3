#!/usr/bin/env bash
# The two compiles whose variants a refactor of compiler/variants/ must leave byte-identical (issue 23):
# MiniLM's auto (cosine budget, cpu + sm_75 + sm_86 + sm_89 + sm_120) and tinylm's decoder auto
# (perplexity-ratio budget, cpu + sm_86). Prints "compile variant sha256" lines; diff two runs' outputs.
# usage: bash bench/variant_hashes.sh OUTDIR [extra compile flags...]
set -euo pipefail
OUT=$1; shift
BIN=${BIN:-.venv/bin}
mkdir -p "$OUT"
$BIN/python -c "import pydoc_data.topics as t; print('\n'.join(list(t.topics.values())[:60]))" > "$OUT/calibration.txt"
$BIN/tensorsmith compile samples/minilm/tensorsmith.toml -o "$OUT/minilm" --precision auto \
    --budget 'cosine>=0.995' --calibration samples/minilm/calibration.npz --eval-data samples/minilm/evaluation.npz \
    --target cpu --target sm_75 --target sm_86 --target sm_89 --target sm_120 --json "$@" > "$OUT/minilm.json"
$BIN/tensorsmith compile samples/tinylm/tensorsmith.toml -o "$OUT/tinylm" --precision auto \
    --budget 'perplexity-ratio<=1.03' --calibration "$OUT/calibration.txt" --target cpu --target sm_86 \
    --json "$@" > "$OUT/tinylm.json"
for compiled in minilm tinylm; do
    $BIN/python -c "
import json, sys
manifest = json.load(open('$OUT/$compiled/manifest.json'))
for variant in manifest['variants']:
    print('$compiled', variant['name'], variant['sha256'])
for target in manifest['targets']:
    print('$compiled', 'target', target['name'], target['variant'], target['status'])
"
done

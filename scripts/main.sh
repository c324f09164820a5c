#!/usr/bin/env bash
# The main job on an embedded default, on a machine with no GPU: inspect the real V4.1-Flash graph,
# compile the tiny model for the cpu target, write its random checkpoint in the real format, and
# generate offline from the compiled plan.
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/venv.sh
out=${DEEPINFER_OUT:-out}
mkdir -p "$out"
deepinfer inspect --model v4.1-flash
deepinfer compile --model v4.1-flash-tiny --target cpu -o "$out/tiny-plan" --max-model-len 4096 --max-num-seqs 16
deepinfer make-checkpoint --model v4.1-flash-tiny -o "$out/tiny-ckpt" --seed 0 --overwrite
deepinfer generate "$out/tiny-plan" --weights "$out/tiny-ckpt" --temperature 0 --max-tokens 16 \
    --prompt "DeepInfer compiles one graph for every target."

#!/usr/bin/env bash
# The main job on an embedded default, on a machine with no GPU: inspect the real V4.1-Flash graph,
# write a random tiny checkpoint in the real format and inspect the tiny graph.
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/venv.sh
out=${DEEPINFER_OUT:-out}
mkdir -p "$out"
deepinfer inspect --model v4.1-flash
deepinfer make-checkpoint --model v4.1-flash-tiny -o "$out/tiny-ckpt" --seed 0 --overwrite
deepinfer inspect --model "$out/tiny-ckpt"

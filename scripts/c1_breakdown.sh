#!/usr/bin/env bash
# Where one stream's time goes between raw generate_step and the served stream (#19), on the GPU machine:
# one mlxserve server, then `bench decode` with every in-process path and the served row, interleaved
# round by round (the in-process paths run after each round's raw/served pair).
# usage (device, .device carried): [PYSPY=SECONDS] bash scripts/c1_breakdown.sh SHAPE [ROUNDS]
set -uo pipefail
shape=${1:-qwen3-0.6b} rounds=${2:-16}
mkdir -p /tmp/site && tar -xJf .device/site.tar.xz -C /tmp/site
[ -f .device/ptx.txz ] && tar -xJf .device/ptx.txz -C /tmp
export PYTHONPATH=/tmp/site:$PWD/src PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
out=${OUT:-/tmp/c1b}; mkdir -p "$out"
m=/tmp/models/$shape
[ -f "$m/config.json" ] || python3 -m mlxserve.cli demo-model "$m" --shape "$shape" --bits 4 > /dev/null
MLXSERVE_STEP_TRACE=$out/steps.tsv python3 -m mlxserve.cli serve "$m" --served-model-name bench --port 8321 > "$out/server.log" 2>&1 &
pid=$!
until curl -sf http://127.0.0.1:8321/v1/models > /dev/null; do sleep 1; done
python3 -m mlxserve.cli bench decode --model "$m" --paths raw,core,thread,async --max-tokens 128 \
  --url http://127.0.0.1:8321 --served-model bench --repeat "$rounds" --output-json "$out/decode.json" 2>&1 \
  | grep -E "^served:"
kill "$pid"; wait "$pid" 2> /dev/null
# PYSPY=SECONDS: then py-spy on a fresh server under one stream (scripts/gpu-pyspy.sh).
[ -n "${PYSPY:-}" ] && bash scripts/gpu-pyspy.sh "$m" 1 "$PYSPY"

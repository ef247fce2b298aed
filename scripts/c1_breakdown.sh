#!/usr/bin/env bash
# Where one stream's time goes between raw generate_step and the served stream (#19), on the GPU machine:
# one mlxserve server, then `bench decode` with every in-process path and the served row, interleaved
# round by round, then py-spy on the server during a served stream (GIL holders, and all samples).
# usage (device, .device carried): bash scripts/c1_breakdown.sh SHAPE [ROUNDS]
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
if [ -f .device/pyspy.whl ]; then
  pip install -q --no-deps --target /tmp/pyspy .device/pyspy.whl > /dev/null 2>&1
  spy=$(find /tmp/pyspy -name py-spy -type f | head -1)
  load() { timeout 60 python3 -m mlxserve.cli bench serve --url http://127.0.0.1:8321 --model bench --endpoint chat \
      --concurrency 1 --num-requests "$1" --max-tokens 256 --warmup 1 --no-json > /dev/null 2>&1; }
  load 40 & sleep 3
  "$spy" record -r 1000 --nonblocking --threads --gil -f raw -o "$out/spy-gil.txt" --pid "$pid" --duration 8 > /dev/null 2>&1
  wait
  load 40 & sleep 3
  "$spy" record -r 1000 --nonblocking --threads --idle -f raw -o "$out/spy-all.txt" --pid "$pid" --duration 8 > /dev/null 2>&1
  wait
fi
kill "$pid"; wait "$pid" 2> /dev/null

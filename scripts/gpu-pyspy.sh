#!/usr/bin/env bash
# Where a served stream's time goes on the GPU machine: mlxserve under `bench serve` load at one
# concurrency, sampled by py-spy (a .device/pyspy.whl carried along) once for the threads that hold the
# GIL and once for all active threads, with the step trace on. Run after scripts/gpu-bench.sh built the model.
# usage: bash scripts/gpu-pyspy.sh MODEL_DIR CONC SECONDS [SERVER FLAGS...]
set -uo pipefail
model=$1 conc=$2 secs=$3
shift 3
export PYTHONPATH=${PYTHONPATH:-/tmp/site:$PWD/src} PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
out=${OUT:-/tmp/gpu-bench}; mkdir -p "$out"
spy=/tmp/pyspy/py_spy-*.data/scripts/py-spy
[ -x $spy ] || { mkdir -p /tmp/pyspy && python3 -m zipfile -e .device/pyspy.whl /tmp/pyspy && chmod +x $spy; }
tag=pyspy-$(basename "$model")-c$conc
port=$((8100 + RANDOM % 800))
MLXSERVE_STEP_TRACE=$out/steps-$tag.tsv python3 -m mlxserve.cli serve "$model" --served-model-name bench \
  --max-num-seqs 64 --port $port "$@" > "$out/server-$tag.log" 2>&1 &
pid=$!
until curl -sf "http://127.0.0.1:$port/v1/models" > /dev/null; do kill -0 $pid || exit 1; sleep 1; done
timeout $((secs * 2 + 60)) python3 -m mlxserve.cli bench serve --url "http://127.0.0.1:$port" --model bench \
  --concurrency "$conc" --num-requests $((conc * 40)) --endpoint chat --warmup 4 --label "$tag" \
  --output-json "$out/serve-$tag.json" > "$out/bench-$tag.log" 2>&1 &
bench=$!
sleep 8
$spy record -p $pid -d "$secs" -r 1000 --threads --gil -f raw -o "$out/$tag-gil.txt" > /dev/null 2>&1
$spy record -p $pid -d "$secs" -r 1000 --threads -f raw -o "$out/$tag-active.txt" > /dev/null 2>&1
kill $bench 2> /dev/null
kill $pid; wait $pid 2> /dev/null
grep -A3 "^label" "$out/bench-$tag.log" | tail -2
ls -la "$out"/$tag-*.txt

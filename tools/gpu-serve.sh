#!/usr/bin/env bash
# One server under `bench serve`'s load on the GPU machine, its log kept in $OUT even when the time limit
# cuts the run (`bench compare` keeps logs in temporary files). Run from tools/gpu-bench.sh, or alone where
# the servers import (PYTHONPATH as gpu-bench.sh sets it).
# usage: bash tools/gpu-serve.sh TAG SECONDS mlxhost|vllm_mlx|mlx_lm MODEL_DIR [SERVER FLAGS...]
# SECONDS bounds start-up, warm-up and load together. Env: CONC (default 1,16,32,64); WAVES=N (each level alone
# with N x its concurrency requests, after 4 warm-up requests before the first level only; default: bench serve's
# four waves, all levels in one run); WAIT_WARMUP=0 (mlxhost: load
# at once instead of after its background warm-up's log line "warm-up finished"); KERNELS=shared keeps
# MLX's default on-disk kernel cache (/tmp/mlx/...), shared with the servers before and after, as on a
# user's machine after a first start; KERNELS=/abs/dir: that folder as every server's MLX_PTX_CACHE_DIR (one
# cache for all servers of a run, mlxhost's included); by default each server gets an empty one of its own.
# PROBE=1 (mlxhost): its start timed by tools/startup_probe.py --attach (ready, first token, 16-stream waves
# while the warm-up runs for PROBE_LOAD_S seconds at most, default 45, then its end awaited without load: its
# pieces run only while the engine is idle), written to $OUT/start-TAG.json, before the load. LOAD=c1: instead of
# `bench serve`, `bench decode --url`: C1_ROUNDS rounds (default 24) of raw generate_step in the bench's process
# and one stream from the server (after a short one that wakes it), back to back and in turns first, 128 tokens
# each (the c=1 criterion: the host's CPU flips between a fast and a slow mode every 1-5 s).
set -uo pipefail
tag=$1 limit=$2 server=$3 model=$4
shift 4
export PYTHONPATH=${PYTHONPATH:-$PWD/src} PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
out=${OUT:-/tmp/gpu-bench}; mkdir -p "$out"
port=$((8100 + RANDOM % 800))
case $server in
  mlxhost) cmd=(python3 -m mlxhost.server.cli serve "$model" --served-model-name bench --max-num-seqs 64) ;;
  vllm_mlx) cmd=(python3 -m vllm_mlx.cli serve "$model" --continuous-batching --max-num-seqs 64
                 --served-model-name bench) ;;
  mlx_lm) cmd=(python3 -m mlx_lm.server --model "$model") ;;
  *) echo "unknown server $server (mlxhost, vllm_mlx or mlx_lm)"; exit 2 ;;
esac
name=bench; [ "$server" = mlx_lm ] && name=$model
kernels=$(mktemp -d)  # each server compiles its own kernels (see bench compare)
server_env=(MLX_PTX_CACHE_DIR="$kernels")
[ "${KERNELS:-}" = shared ] && server_env=()
[[ ${KERNELS:-} == /* ]] && mkdir -p "$KERNELS" && server_env=(MLX_PTX_CACHE_DIR="$KERNELS")
# With MLXHOST_STEP_TRACE set, each server's step trace goes to its own file in $OUT.
[ -n "${MLXHOST_STEP_TRACE:-}" ] && server_env+=(MLXHOST_STEP_TRACE="$out/steps-$tag.tsv")
stop() {
  kill "$pid" 2> /dev/null
  timeout 30 tail --pid="$pid" -f /dev/null || kill -9 "$pid" 2> /dev/null
  rm -rf "$kernels"
}
start=$(date +%s) launched=$(date +%s.%N)
# The launch stamped in the log the way the servers stamp their lines: each line's time since launch reads off it.
date -d "@$launched" '+%Y-%m-%d %H:%M:%S,%3N gpu-serve: launching' > "$out/server-$tag.log"
env "${server_env[@]}" "${cmd[@]}" --port "$port" "$@" >> "$out/server-$tag.log" 2>&1 &
pid=$!
if [ "$server" = mlxhost ] && [ "${PROBE:-0}" = 1 ]; then
  timeout "$limit" python3 tools/startup_probe.py --attach "http://127.0.0.1:$port" --server-log "$out/server-$tag.log" \
    --launched-at "$launched" --label "$tag" --load-s "${PROBE_LOAD_S:-45}" --wait-warmup-s "$limit" \
    --out "$out/start-$tag.json" | head -4
fi
until curl -sf "http://127.0.0.1:$port/v1/models" > /dev/null; do
  if ! kill -0 "$pid" 2> /dev/null; then
    echo "$tag: server exited"; tail -20 "$out/server-$tag.log"; rm -rf "$kernels"; exit 1
  fi
  if (($(date +%s) - start >= limit)); then
    echo "$tag: not up within $limit s"; stop
    grep -E "warm-up|slow engine step|Traceback|ERROR" "$out/server-$tag.log" | cut -c1-300 | tail -25
    exit 1
  fi
  sleep 1
done
echo "$tag: up after $(($(date +%s) - start)) s"
# mlxhost answers while its warm-up still runs (engine/warmup.py); the load measures the warmed server, as
# before, unless WAIT_WARMUP=0.
if [ "$server" = mlxhost ] && [ "${WAIT_WARMUP:-1}" = 1 ]; then
  until grep -q "warm-up finished" "$out/server-$tag.log" || (($(date +%s) - start >= limit)); do sleep 1; done
  echo "$tag: warm-up finished after $(($(date +%s) - start)) s"
fi
left=$((limit - $(date +%s) + start))
echo "$tag: $left s left for the load"
if ((left > 0)) && [ "${LOAD:-serve}" = c1 ]; then
  timeout "$left" python3 -m mlxhost.server.cli bench decode --model "$model" --paths raw --max-tokens 128 \
    --url "http://127.0.0.1:$port" --served-model "$name" --repeat "${C1_ROUNDS:-24}" \
    --output-json "$out/c1-$tag.json" > "$out/bench-$tag.log" 2>&1
  echo "$tag: bench exit $?"
elif ((left > 0)) && [ -n "${WAVES:-}" ]; then
  # One bench run per level, N waves each, merged into one serve JSON (the levels in order) for pool_serve.py.
  warm=4 parts=()
  for c in ${CONC//,/ }; do
    left=$((limit - $(date +%s) + start)); ((left > 0)) || break
    timeout "$left" python3 -m mlxhost.server.cli bench serve --url "http://127.0.0.1:$port" --model "$name" \
      --concurrency "$c" --num-requests $((WAVES * c)) --endpoint chat --warmup $warm --label "$tag" \
      --output-json "$out/serve-$tag.c$c.part" >> "$out/bench-$tag.log" 2>&1 || break
    parts+=("$out/serve-$tag.c$c.part") warm=0
  done
  ((${#parts[@]})) && python3 -c 'import json, sys
runs = [json.load(open(p)) for p in sys.argv[2:]]
json.dump(dict(runs[0], levels=[lv for r in runs for lv in r["levels"]]), open(sys.argv[1], "w"))' \
    "$out/serve-$tag.json" "${parts[@]}" && rm -f "${parts[@]}"
  echo "$tag: ${#parts[@]} levels of $WAVES waves"
elif ((left > 0)); then
  timeout "$left" python3 -m mlxhost.server.cli bench serve --url "http://127.0.0.1:$port" \
    --model "$name" --concurrency "${CONC:-1,16,32,64}" --endpoint chat --warmup 4 --label "$tag" \
    --output-json "$out/serve-$tag.json" > "$out/bench-$tag.log" 2>&1
  echo "$tag: bench exit $?"
fi
stop
grep -v "httpx" "$out/bench-$tag.log" 2> /dev/null | grep -A8 "^label" | tail -8
grep -E "^served:" "$out/bench-$tag.log" 2> /dev/null
grep -E "warm-up|slow engine step|Traceback|ERROR|without any text" "$out/server-$tag.log" | cut -c1-300 | tail -25

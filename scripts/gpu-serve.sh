#!/usr/bin/env bash
# One server under `bench serve`'s load on the GPU machine, its log kept in $OUT even when a time limit
# cuts the run (`bench compare` keeps logs in temporary files). Same bundle as scripts/gpu-bench.sh.
# usage: bash scripts/gpu-serve.sh TAG SECONDS mlxserve|vllm_mlx|mlx_lm MODEL_DIR [SERVER FLAGS...]
# Env: CONC (default 1,16,32,64).
set -uo pipefail
tag=$1 limit=$2 server=$3 model=$4
shift 4
out=${OUT:-/tmp/gpu-bench}; mkdir -p "$out"
port=$((8100 + RANDOM % 800))
case $server in
  mlxserve) cmd=(python3 -m mlxserve.cli serve "$model" --served-model-name bench --max-num-seqs 64) ;;
  vllm_mlx) cmd=(python3 -m vllm_mlx.cli serve "$model" --continuous-batching --max-num-seqs 64
                 --served-model-name bench) ;;
  mlx_lm) cmd=(python3 -m mlx_lm.server --model "$model") ;;
esac
name=bench; [ "$server" = mlx_lm ] && name=$model
export MLX_PTX_CACHE_DIR=$(mktemp -d)  # each server compiles its own kernels (see bench compare)
start=$(date +%s)
"${cmd[@]}" --port "$port" "$@" > "$out/server-$tag.log" 2>&1 &
pid=$!
until curl -sf "http://127.0.0.1:$port/v1/models" > /dev/null; do
  kill -0 $pid 2> /dev/null || { echo "$tag: server exited"; tail -20 "$out/server-$tag.log"; exit 1; }
  sleep 1
done
echo "$tag: up after $(($(date +%s) - start)) s"
left=$((limit - $(date +%s) + start))
[ $left -gt 0 ] || { echo "$tag: no time left for the load after start-up"; left=1; }
timeout $left python3 -m mlxserve.cli bench serve --url "http://127.0.0.1:$port" \
  --model "$name" --concurrency "${CONC:-1,16,32,64}" --endpoint chat --warmup 4 --label "$tag" \
  --output-json "$out/serve-$tag.json" > "$out/bench-$tag.log" 2>&1
echo "$tag: bench exit $?"
kill $pid; wait $pid 2> /dev/null
grep -v "httpx" "$out/bench-$tag.log" | grep -A8 "^label" | tail -8
grep -E "warm-up|slow engine step|Traceback|ERROR|empty|without any text" "$out/server-$tag.log" | cut -c1-300 | tail -8

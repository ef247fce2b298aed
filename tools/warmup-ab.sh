#!/usr/bin/env bash
# What the background warm-up leaves behind that slows a lone stream (docs/BENCHMARKS.md, "One stream on MLX-CUDA"):
# several `mlxhost serve` of one random 4-bit shape up at once on one GPU, each a variant, then for each in turn a
# new prompt length timed (does it stall?) and `bench decode --paths raw --url` (served against raw generate_step,
# paired rounds). Variants: A the warm-up's steps on the engine thread (MLXHOST_WARMUP_ISOLATE=off, the default
# before MLX-CUDA moved them to a thread of their own); B --warmup off; AW on a thread of their own
# (=thread, today's default on MLX-CUDA); AS on a stream of their own (=stream); AN as A without CUDA graphs
# (MLX_USE_CUDA_GRAPHS=0); AT as A with gc.collect + malloc_trim after the warm-up (MLXHOST_WARMUP_AFTER=trim); AF
# as A with gc.freeze after it (=collect,freeze). A starts first and its warm-up fills the kernel cache before the
# others start.
# Needs what gpu-bench.sh needs (MLX_SITE_BUNDLE or an environment where mlx's CUDA build and mlxhost import).
# usage: bash tools/warmup-ab.sh [SHAPE] (default qwen3-0.6b; MODEL=DIR serves that folder instead). Env: VARIANTS (default A,B,AW,AN,AT), ROUNDS
# (paired rounds per variant and block, default 3), BLOCKS (default 2), OUT (default /tmp/warmup-ab).
set -uo pipefail
source "$(dirname "$0")/site-env.sh"
out=${OUT:-/tmp/warmup-ab}; mkdir -p "$out"
shape=${1:-qwen3-0.6b}; m=${MODEL:-/tmp/models/$shape}
[ -f "$m/config.json" ] || python3 -m mlxhost.server.cli demo-model "$m" --shape "$shape" --bits 4 > /dev/null
declare -A FLAGS=([A]="" [B]="--warmup off" [AW]="" [AS]="" [AN]="" [AT]="" [AF]="")
off=MLXHOST_WARMUP_ISOLATE=off
declare -A ENVS=([A]="$off" [B]="X=1" [AW]="MLXHOST_WARMUP_ISOLATE=thread" [AS]="MLXHOST_WARMUP_ISOLATE=stream"
                 [AN]="$off MLX_USE_CUDA_GRAPHS=0" [AT]="$off MLXHOST_WARMUP_AFTER=trim"
                 [AF]="$off MLXHOST_WARMUP_AFTER=collect,freeze")
IFS=, read -ra names <<< "${VARIANTS:-A,B,AW,AN,AT}"
pids=(); port=8100; declare -A PORT=()
trap 'kill -INT "${pids[@]}" 2> /dev/null' EXIT
for n in "${names[@]}"; do
  port=$((port + 1)); PORT[$n]=$port
  env ${ENVS[$n]} python3 -m mlxhost.server.cli serve "$m" --port $port --served-model-name bench ${FLAGS[$n]} \
    > "$out/serve-$n.log" 2>&1 &
  pids+=($!)
  for _ in $(seq 1 200); do curl -sf http://127.0.0.1:$port/health > /dev/null && break; sleep 1; done
  # The first server's warm-up fills the kernel cache; the others then compile nothing beside one another.
  [ ${#pids[@]} = 1 ] && [ "$n" != B ] && for _ in $(seq 1 200); do grep -q "warm-up finished" "$out/serve-$n.log" && break; sleep 1; done
  echo "$n up on $port"
done
for _ in $(seq 1 120); do  # every warm-up over (B has none)
  left=0; for n in "${names[@]}"; do [ "$n" != B ] && ! grep -q "warm-up finished" "$out/serve-$n.log" && left=1; done
  [ $left = 0 ] && break; sleep 1
done
prompt=$(printf 'w%.0s ' $(seq 1 333))
for n in "${names[@]}"; do
  echo "$n: a new prompt length answered in $(curl -s -o /dev/null -w '%{time_total}' http://127.0.0.1:${PORT[$n]}/v1/completions \
    -H 'content-type: application/json' -d '{"model":"bench","prompt":"'"$prompt"'","max_tokens":4}') s"
done
for blk in $(seq 1 "${BLOCKS:-2}"); do
  for n in "${names[@]}"; do
    timeout 120 python3 -m mlxhost.server.cli bench decode --model "$m" --paths raw --url http://127.0.0.1:${PORT[$n]} \
      --repeat "${ROUNDS:-3}" --output-json "$out/decode-$n-$blk.json" 2>&1 | grep "served:" | sed "s/^/$n block $blk: /"
  done
done
nvidia-smi --query-compute-apps=pid,used_memory --format=csv,noheader 2> /dev/null

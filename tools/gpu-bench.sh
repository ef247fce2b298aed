#!/usr/bin/env bash
# The GPU comparison in one run: random 4-bit Qwen3 shapes, mlx-lm's raw generate_step, mlxhost,
# mlx_lm.server and vllm-mlx under the same load generator (docs/BENCHMARKS.md, GPU serving).
#
# Needs an MLX-CUDA machine where mlx (CUDA build), mlx-lm, mlx-vlm, vllm-mlx 0.6.0 and mlxhost's dependencies
# import: either installed in the running environment, or an MLX-CUDA wheel bundle (those packages' site-packages
# folder packed as a .tar.xz) named by MLX_SITE_BUNDLE, which is unpacked into /tmp/site and put first on PYTHONPATH.
# The versions measured: mlx-lm 0.32.2, mlx-vlm 0.7.10, vllm-mlx 0.6.0, fastapi 0.165.0, uvicorn 0.54.0.
# usage: bash tools/gpu-bench.sh [SHAPE ...] (default: qwen3-0.6b)
# Env: SERVERS (default mlxhost,mlx_lm,vllm_mlx), CONC (default 1,16,32), STEPS (default decode,compare,burst;
# c1 adds mlxhost's single stream timed against raw generate_step round by round, see LOAD=c1 in gpu-serve.sh),
# MLXHOST_ARGS (more `mlxhost serve` flags), TAG (suffix of the result files, for a second configuration),
# SERVER_S (seconds each server may take, start-up and warm-up included; default 240), KERNELS=shared (one
# on-disk kernel cache for every server of the run, see gpu-serve.sh; KERNEL_CACHE_ARCHIVE, a .tar.xz of an
# earlier run's /tmp/mlx kernel cache, is unpacked into it first), BURST_STEPS (prefill step sizes the burst
# compares, default 512,2048), BURST_ROWS (default 1,8), BURST_CUDNN (--cudnn-attention values the burst runs
# under, default auto; e.g. auto,off), BURST_S (each burst run's time limit, default 300). SERVERS may name
# mlxhost-cudnn-off: mlxhost again with --cudnn-attention off, and mlxhost-TAG: mlxhost again with the flags
# in $ARGS_TAG and the environment in $ENV_TAG (e.g. SERVERS=mlxhost,mlxhost-wait4 ARGS_wait4="--prefill-wait-steps 4",
# SERVERS=mlxhost,mlxhost-nofold ENV_nofold=MLXHOST_FOLD_ROWS=0). A name may come more than once
# (SERVERS=mlxhost,vllm_mlx,mlxhost,vllm_mlx: starts in turns, so the host's drift hits each server alike):
# its second start writes serve-<name>-<shape>$TAG-2.json, the third -3 ... After the compare step
# tools/pool_serve.py prints each server's aggregate per level pooled over its starts (tokens / wall
# seconds), mlxhost's over each other server's, TTFT p50/p99 over all their requests and the first wave's
# p50, and the errors, into $OUT/pooled-<shape>$TAG.json. gpu-serve.sh's WAVES, PROBE and KERNELS=/dir pass
# through (e.g. WAVES=8 PROBE=1 KERNELS=/tmp/kernels: 8 waves per level, every server on one kernel folder that
# the first mlxhost start fills from empty, each mlxhost start timed from launch).
set -uo pipefail
source "$(dirname "$0")/site-env.sh"
[ "${KERNELS:-}" = shared ] && [ -f "${KERNEL_CACHE_ARCHIVE:-}" ] && tar -xJf "$KERNEL_CACHE_ARCHIVE" -C /tmp
out=${OUT:-/tmp/gpu-bench}; mkdir -p "$out"
shapes=("${@:-qwen3-0.6b}")
servers=${SERVERS:-mlxhost,mlx_lm,vllm_mlx}
conc=${CONC:-1,16,32}
steps=${STEPS:-decode,compare,burst}
BURST_CUDNN=${BURST_CUDNN:-auto}
python3 -c "import mlx.core as mx; print('mlx', mx.__version__, mx.default_device())"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
for shape in "${shapes[@]}"; do
  m=/tmp/models/$shape
  [ -f "$m/config.json" ] || python3 -m mlxhost.server.cli demo-model "$m" --shape "$shape" --bits 4 >/dev/null
  echo "=== $shape"
  if [[ $steps == *decode* ]]; then
    python3 -m mlxhost.server.cli bench decode --model "$m" --max-tokens 256 --output-json "$out/decode-$shape.json"
  fi
  if [[ $steps == *c1* ]]; then
    read -ra extra <<< "${MLXHOST_ARGS:-}"
    LOAD=c1 bash tools/gpu-serve.sh "c1-mlxhost-$shape${TAG:-}" "${SERVER_S:-240}" mlxhost "$m" "${extra[@]}"
  fi
  if [[ $steps == *compare* ]]; then
    # One server at a time under the same load, each within SERVER_S seconds from its start (warm-up
    # included), its log kept in $OUT: a limit that cuts one server loses nothing of the others.
    declare -A num_starts=()
    for server in ${servers//,/ }; do
      n=$((${num_starts[$server]:-0} + 1)); num_starts[$server]=$n
      suffix=; ((n > 1)) && suffix=-$n  # a repeated name's later starts: -2, -3 ...
      extra=() kind=$server envs=()
      case $server in
        mlxhost) read -ra extra <<< "${MLXHOST_ARGS:-}" ;;
        mlxhost-cudnn-off) kind=mlxhost; read -ra extra <<< "${MLXHOST_ARGS:-} --cudnn-attention off" ;;
        mlxhost-*) kind=mlxhost; v="ARGS_${server#mlxhost-}" e="ENV_${server#mlxhost-}"
                    read -ra extra <<< "${MLXHOST_ARGS:-} ${!v:-}"; read -ra envs <<< "${!e:-}" ;;
      esac
      env "${envs[@]}" CONC=$conc bash tools/gpu-serve.sh "$server-$shape${TAG:-}$suffix" "${SERVER_S:-240}" \
        "$kind" "$m" "${extra[@]}"
    done
    python3 tools/pool_serve.py "$out" "$shape${TAG:-}"
  fi
  if [[ $steps == *burst* ]]; then
    # 8 mixed-length prompts at once, prefilled one by one (rows 1) vs together (rows 8), per cuDNN setting.
    cache=fresh; [ "${KERNELS:-}" = shared ] && cache=shared
    for cudnn in ${BURST_CUDNN//,/ }; do
      MLXHOST_STEP_TRACE=${MLXHOST_STEP_TRACE:+$out/steps-burst-$shape-$cudnn.tsv} timeout "${BURST_S:-300}" \
        python3 -m mlxhost.server.cli bench burst --model "$m" --rows "${BURST_ROWS:-1,8}" \
        --prefill-step-sizes "${BURST_STEPS:-512,2048}" --repeats 3 --max-tokens 64 --kernel-cache "$cache" \
        --serve-args "--cudnn-attention $cudnn" --output-json "$out/burst-$shape-$cudnn.json" \
        > "$out/burst-$shape-$cudnn.log" 2>&1
      grep -v "httpx" "$out/burst-$shape-$cudnn.log" | tail -12
    done
  fi
done

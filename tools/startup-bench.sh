#!/usr/bin/env bash
# Start-up on an MLX-CUDA machine (docs/BENCHMARKS.md, Start-up): for each random 4-bit shape, a cold start
# (empty MLX kernel cache and start-up measurements: a fresh machine) and a warm restart (the kernel cache the cold start filled), each
# timed from launch by tools/startup_probe.py: ready, first token, requests sent during the warm-up, the
# warm-up's end. Needs what gpu-bench.sh needs (MLX_SITE_BUNDLE or an environment where mlx's CUDA build,
# mlx-lm, mlxhost's dependencies and httpx import).
# usage: bash tools/startup-bench.sh [SHAPE ...] (default: qwen3-0.6b)
# Env: LOAD_S (seconds of c=CONC load sent right after the first request, default 45), CONC (default 16),
# WAIT_S (how long the cold start may take to end its warm-up before the probe stops it, default 200),
# WARM_WAIT_S (the same for the warm restart, default 30),
# SHARE=1 (the later shapes' cold starts reuse the first shape's kernel cache: only their own kernels are new).
set -uo pipefail
source "$(dirname "$0")/site-env.sh"
out=${OUT:-/tmp/startup-bench}; mkdir -p "$out"
python3 -c "import mlx.core as mx; print('mlx', mx.__version__, mx.default_device(), mx.device_info().get('device_name'))"
first=
for shape in "${@:-qwen3-0.6b}"; do
  m=/tmp/models/$shape
  t=$(date +%s)
  [ -f "$m/config.json" ] || python3 -m mlxhost.server.cli demo-model "$m" --shape "$shape" --bits 4 > /dev/null
  echo "=== $shape (model built in $(($(date +%s) - t)) s)"
  kernels=/tmp/kernels-$shape
  rm -rf "$kernels"; mkdir -p "$kernels"
  [ "${SHARE:-0}" = 1 ] && [ -n "$first" ] && cp -r "$first"/. "$kernels"/
  # Nor what earlier starts kept (the activation measurement, the loaded tokenizer: every shape has Qwen3's).
  rm -rf "$(python3 -c 'import platformdirs; print(platformdirs.user_cache_dir("mlxhost"))')/measurements"
  sync; echo 3 > /proc/sys/vm/drop_caches 2> /dev/null  # weights read from disk, as after a reboot (root only)
  limit=$((${LOAD_S:-45} + ${WAIT_S:-200} + 120))
  timeout "$limit" python3 tools/startup_probe.py "$m" --label "cold-$shape" --kernel-dir "$kernels" \
    --load-s "${LOAD_S:-45}" --concurrency "${CONC:-16}" --wait-warmup-s "${WAIT_S:-200}" \
    --out "$out/cold-$shape.json" || { echo "cold start of $shape failed"; exit 1; }
  echo "kernel cache after the cold start: $(find "$kernels" -name '*.ptx' | wc -l) modules"
  # When each module landed, oldest first: which compile held up which phase of the start (read with the log).
  find "$kernels" -name '*.ptx' -not -path '*/.staging-*' -printf '%TT %f\n' | sort > "$out/kernels-cold-$shape.txt"
  timeout 150 python3 tools/startup_probe.py "$m" --label "warm-$shape" --kernel-dir "$kernels" --load-s 10 \
    --concurrency "${CONC:-16}" --wait-warmup-s "${WARM_WAIT_S:-30}" --out "$out/warm-$shape.json"
  [ -z "$first" ] && first=$kernels
done

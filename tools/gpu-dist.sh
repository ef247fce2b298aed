#!/usr/bin/env bash
# Distributed serving on a 2-GPU MLX-CUDA machine: `mlxhost bench distributed` (1 rank vs tensor parallel vs
# pipeline parallel, all over NCCL), every server's log and step trace kept in $OUT.
# Needs MLX's CUDA build and mlxhost's dependencies importable (installed, or a site-packages archive named by
# MLX_SITE_BUNDLE, unpacked into /tmp/site) and NCCL (the nvidia-nccl-cu13 wheel: its lib folder goes on
# LD_LIBRARY_PATH). NVLink multicast stays off (NCCL_NVLS_ENABLE=0).
# usage: PART=8b bash tools/gpu-dist.sh    (one part per call of a machine that stays up between calls)
#   PART=8b:  tools/allsum_probe.py (per-call cost of NCCL's all_sum / all_gather at the 8B and 32B widths),
#             then the random 4-bit Qwen3-8B shape: layouts 1, tp2, pp2, a rank killed under streams (tp2, pp2).
#   PART=32b: the random bf16 Qwen3-32B shape (built once, ~65 GB, in /dev/shm when it has room: written and
#             read back at memory speed, and still there for a later call on the same machine): 1, tp2, pp2,
#             then tools/tp_step_probe.py (mlx-lm's own tensor parallel on the same shape).
# Env: CALL_S (the time this whole run may take, default 585 s: each step's limit is what is left of it),
# BENCH_ARGS (more `bench distributed` flags), BENCH_S (the bench's time limit), LAYOUTS (default 1,tp2,pp2).
set -uo pipefail
t0=$(date +%s)
left() { echo $(( ${CALL_S:-585} - ($(date +%s) - t0) )); }  # what is left of the run's time (CALL_S)
if [ -n "${MLX_SITE_BUNDLE:-}" ]; then
  [ -d /tmp/site/mlx ] || { mkdir -p /tmp/site && tar -xJf "$MLX_SITE_BUNDLE" -C /tmp/site; }
  export PYTHONPATH=/tmp/site:$PWD/src
else
  export PYTHONPATH=$PWD/src${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 NCCL_NVLS_ENABLE=0
nccl=$(python3 -c "import nvidia.nccl as n; print(list(n.__path__)[0] + '/lib')" 2> /dev/null) &&
  export LD_LIBRARY_PATH=$nccl${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
echo "NCCL libraries: ${nccl:-not found}"
out=${OUT:-/tmp/gpu-dist}; mkdir -p "$out"
part=${PART:-8b}
# Model folders: /dev/shm when it can hold the 32B shape, else /tmp (kept across calls while the machine is up).
shm_free=$(df -B1G --output=avail /dev/shm 2> /dev/null | tail -1 | tr -d ' ')
if [ "${shm_free:-0}" -gt 90 ]; then root=/dev/shm/dist-models; else root=/tmp/dist-models; fi
echo "part $part, models in $root (/dev/shm free: ${shm_free:-?} GB)"; mkdir -p "$root"
nvidia-smi --query-gpu=name,memory.total,memory.used --format=csv,noheader
python3 -c "import mlx.core as mx; print('mlx', mx.__version__, mx.default_device())"
bench=(python3 -m mlxhost.server.cli bench distributed --model-root "$root" --startup-timeout 300
       --layouts "${LAYOUTS:-1,tp2,pp2}" --server-flag=--distributed-timeout=60 --kernel-cache fresh)
read -ra extra <<< "${BENCH_ARGS:-}"
case $part in
  8b)
    for run in "4096 1" "5120 1" "5120 0"; do  # width, MLX_USE_CUDA_GRAPHS (MLX-CUDA's kernel batching)
      read -r h graphs <<< "$run"
      MLX_USE_CUDA_GRAPHS=$graphs timeout 90 python3 tools/allsum_probe.py --backend nccl --hidden "$h" \
        --calls 128 2>&1 | grep '^{' | sed "s/^{/{\"cuda_graphs\": $graphs, /" | tee -a "$out/allsum.jsonl"
    done
    timeout -s INT -k 15 "${BENCH_S:-$(left)}" "${bench[@]}" --shapes qwen3-8b --bits 4 --waves 2 --kill-test \
      --output-json "$out/dist-8b.json" "${extra[@]}" > "$out/dist-8b.log" 2>&1
    echo "8B part: exit $?"; grep -v "httpx" "$out/dist-8b.log" | tail -40 ;;
  32b)
    for graphs in 1 0; do  # the layer-like test: does an all-reduce make the host wait for the device?
      MLX_USE_CUDA_GRAPHS=$graphs timeout 90 python3 tools/allsum_probe.py --backend nccl --hidden 5120 \
        --calls 128 --repeat 5 2>&1 | grep '^{' | sed "s/^{/{\"cuda_graphs\": $graphs, /" | tee -a "$out/allsum.jsonl"
    done
    start=$(date +%s)
    timeout 240 python3 -c "
import sys; from pathlib import Path; from mlxhost.bench.distributed import ensure_shape
print(ensure_shape(Path(sys.argv[1]), 'qwen3-32b', None))" "$root" 2>&1 | tail -3
    echo "32B folder ready after $(( $(date +%s) - start )) s: $(du -sh "$root/qwen3-32b-floatbit" | cut -f1)"
    limit=$(( $(left) - 110 )); [ "$limit" -gt 60 ] || limit=60  # (the probe after it takes ~100 s)
    timeout -s INT -k 15 "${BENCH_S:-$limit}" "${bench[@]}" --shapes qwen3-32b --bits 0 --waves 1 \
      --warmup 1 --output-json "$out/dist-32b.json" "${extra[@]}" > "$out/dist-32b.log" 2>&1
    echo "32B part: exit $?"; grep -v "httpx" "$out/dist-32b.log" | tail -16
    if [ "$(left)" -gt 100 ]; then  # mlx-lm's own tensor parallel, graphs off as the server runs it
      MLX_USE_CUDA_GRAPHS=0 timeout "$(( $(left) - 5 ))" python3 tools/tp_step_probe.py --backend nccl \
        --shape qwen3-32b 2>&1 | grep '^{' | tee "$out/tp-probe.jsonl"
    fi ;;
  *) echo "PART must be 8b or 32b"; exit 2 ;;
esac
# The servers' logs and step traces, cut to what explains a stall, in one archive (few files come back).
mkdir -p /tmp/dist-logs && rm -f /tmp/dist-logs/*
for f in "$root"/server-*.log "$root"/server-*.steps.tsv; do
  [ -f "$f" ] && grep -v "httpx\|GET /health" "$f" | tail -c 4000000 > "/tmp/dist-logs/$(basename "$f")"
done
tar -czf "$out/server-logs-$part.tar.gz" -C /tmp/dist-logs .

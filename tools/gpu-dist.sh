#!/usr/bin/env bash
# Distributed serving on a 2-GPU MLX-CUDA machine in one run: `mlxserve bench distributed` (1 rank vs tensor
# parallel over NCCL, then 1 rank vs pipeline parallel over ring), every server's log kept in $OUT.
# Needs MLX's CUDA build and mlxserve's dependencies importable (installed, or a site-packages archive named by
# MLX_SITE_BUNDLE, unpacked into /tmp/site) and NCCL (the nvidia-nccl-cu13 wheel: its lib folder goes on
# LD_LIBRARY_PATH). NVLink multicast stays off (NCCL_NVLS_ENABLE=0).
# usage: bash tools/gpu-dist.sh   Env: TP_ARGS / PP_ARGS (more `bench distributed` flags of each part, e.g.
# "--shapes qwen3-8b,qwen3-32b"; PP_ARGS=skip skips the pipeline part), TP_S / PP_S (each part's time limit).
set -uo pipefail
if [ -n "${MLX_SITE_BUNDLE:-}" ]; then
  mkdir -p /tmp/site && tar -xJf "$MLX_SITE_BUNDLE" -C /tmp/site
  export PYTHONPATH=/tmp/site:$PWD/src
else
  export PYTHONPATH=$PWD/src${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 NCCL_NVLS_ENABLE=0
nccl=$(python3 -c "import nvidia.nccl as n; print(list(n.__path__)[0] + '/lib')" 2> /dev/null) &&
  export LD_LIBRARY_PATH=$nccl${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
echo "NCCL libraries: ${nccl:-not found}"; ls "${nccl:-/nonexistent}" 2> /dev/null | head -3
out=${OUT:-/tmp/gpu-dist}; mkdir -p "$out"
root=/tmp/dist-models
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
python3 -c "import mlx.core as mx; print('mlx', mx.__version__, mx.default_device())"
bench=(python3 -m mlxserve.server.cli bench distributed --model-root "$root" --kill-test
       --startup-timeout 240)
read -ra tp_args <<< "${TP_ARGS:-}"
timeout "${TP_S:-380}" "${bench[@]}" --shapes qwen3-8b --layouts 1,tp2 --output-json "$out/tp.json" "${tp_args[@]}" \
  > "$out/tp.log" 2>&1
echo "tensor parallel part: exit $?"; grep -v "httpx" "$out/tp.log" | tail -25
if [ "${PP_ARGS:-}" != skip ]; then
  read -ra pp_args <<< "${PP_ARGS:-}"
  timeout "${PP_S:-170}" "${bench[@]}" --shapes qwen2-8b --layouts 1,pp2 --output-json "$out/pp.json" \
    "${pp_args[@]}" > "$out/pp.log" 2>&1
  echo "pipeline parallel part: exit $?"; grep -v "httpx" "$out/pp.log" | tail -25
fi
# The servers' logs, cut to what explains a stall (each file comes back whole only under 16 MB).
for f in "$root"/server-*.log; do
  [ -f "$f" ] && grep -v "httpx\|GET /health" "$f" | tail -c 4000000 > "$out/$(basename "$f")"
done

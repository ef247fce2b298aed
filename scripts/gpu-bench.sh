#!/usr/bin/env bash
# The GPU comparison of issue #19 in one device call: random 4-bit Qwen3 shapes, mlx-lm's raw
# generate_step, mlxserve, mlx_lm.server and vllm-mlx under the same load generator.
#
# Here (once):  bash ../shared/tools/device-bundle.sh .device mlx-lm==0.32.2 mlx-vlm==0.7.10 vllm-mlx==0.6.0 \
#                 fastapi==0.165.0 starlette==1.10.0 uvicorn==0.54.0 pydantic pydantic-core typing-inspection \
#                 annotated-types annotated-doc opentelemetry-api importlib-metadata llguidance fastapi-offline swagger-ui-bundle \
#                 platformdirs python-multipart jsonschema jsonschema-specifications referencing rpds-py pytz mcp \
#                 sse-starlette httpx-sse pydantic-settings python-dotenv
# On the device (carry .device):  bash scripts/gpu-bench.sh [SHAPE ...] (default: qwen3-0.6b)
# Env: SERVERS (default mlxserve,mlx_lm,vllm_mlx), CONC (default 1,16,32), STEPS (default decode,compare,burst),
# MLXSERVE_ARGS (more `mlxserve serve` flags), TAG (suffix of the result files, for a second configuration),
# SERVER_S (seconds each server may take, start-up and warm-up included; default 240), KERNELS=shared (one
# on-disk kernel cache for every server of the call, see gpu-serve.sh; a .device/ptx.txz carried along, the
# cache an earlier call brought back, is unpacked into it first), BURST_STEPS (prefill step sizes the burst
# compares, default 512,2048), BURST_S (its time limit, default 300).
set -uo pipefail
mkdir -p /tmp/site && tar -xJf .device/site.tar.xz -C /tmp/site
export PYTHONPATH=/tmp/site:$PWD/src PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
[ "${KERNELS:-}" = shared ] && [ -f .device/ptx.txz ] && tar -xJf .device/ptx.txz -C /tmp
out=${OUT:-/tmp/gpu-bench}; mkdir -p "$out"
shapes=("${@:-qwen3-0.6b}")
servers=${SERVERS:-mlxserve,mlx_lm,vllm_mlx}
conc=${CONC:-1,16,32}
steps=${STEPS:-decode,compare,burst}
python3 -c "import mlx.core as mx; print('mlx', mx.__version__, mx.default_device())"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
for shape in "${shapes[@]}"; do
  m=/tmp/models/$shape
  [ -f "$m/config.json" ] || python3 -m mlxserve.cli demo-model "$m" --shape "$shape" --bits 4 >/dev/null
  echo "=== $shape"
  if [[ $steps == *decode* ]]; then
    python3 -m mlxserve.cli bench decode --model "$m" --max-tokens 256 --output-json "$out/decode-$shape.json"
  fi
  if [[ $steps == *compare* ]]; then
    # One server at a time under the same load, each within SERVER_S seconds from its start (warm-up
    # included), its log kept in $OUT: a limit that cuts one server loses nothing of the others.
    for server in ${servers//,/ }; do
      extra=(); [ "$server" = mlxserve ] && read -ra extra <<< "${MLXSERVE_ARGS:-}"
      CONC=$conc bash scripts/gpu-serve.sh "$server-$shape${TAG:-}" "${SERVER_S:-240}" "$server" "$m" "${extra[@]}"
    done
  fi
  if [[ $steps == *burst* ]]; then
    # 8 mixed-length prompts at once, prefilled one by one (rows 1) vs together (rows 8).
    MLXSERVE_STEP_TRACE=${MLXSERVE_STEP_TRACE:+$out/steps-burst-$shape.tsv} timeout "${BURST_S:-300}" \
      python3 -m mlxserve.cli bench burst --model "$m" --rows 1,8 --prefill-step-sizes "${BURST_STEPS:-512,2048}" \
      --repeats 3 --max-tokens 64 --output-json "$out/burst-$shape.json" > "$out/burst-$shape.log" 2>&1
    grep -v "httpx" "$out/burst-$shape.log" | tail -12
  fi
done

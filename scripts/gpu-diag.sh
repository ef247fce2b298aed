#!/usr/bin/env bash
# One mlxserve server on the GPU machine under the compare load, with its own log: warm-up, slow steps,
# memory after warm-up (GET /v1/status). Usage (device, carry .device): bash scripts/gpu-diag.sh [SERVE FLAGS]
set -uo pipefail
mkdir -p /tmp/site && tar -xJf .device/site.tar.xz -C /tmp/site
export PYTHONPATH=/tmp/site:$PWD/src PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
out=${OUT:-/tmp/gpu-diag}; mkdir -p "$out"; m=/tmp/models/qwen3-0.6b
[ -f "$m/config.json" ] || python3 -m mlxserve.cli demo-model "$m" --shape qwen3-0.6b --bits 4 >/dev/null 2>&1
python3 -m mlxserve.cli serve "$m" --port 8123 --served-model-name bench "$@" > "$out/server.log" 2>&1 &
pid=$!
for i in $(seq 600); do curl -sf http://127.0.0.1:8123/v1/models >/dev/null && break; sleep 0.5; done
curl -s http://127.0.0.1:8123/v1/status | python3 -c "import json,sys; m=json.load(sys.stdin)['memory']; print('after start-up:', {k: round(v/2**30,2) for k,v in m.items() if k.startswith('mlx') and v})"
timeout 240 python3 -m mlxserve.cli bench serve --url http://127.0.0.1:8123 --model bench --endpoint chat \
  --concurrency 1,16,32 --warmup 4 --no-json 2>&1 | grep -v "httpx\|^level" | tail -6
curl -s http://127.0.0.1:8123/v1/status | python3 -c "import json,sys; m=json.load(sys.stdin)['memory']; print('after load:', {k: round(v/2**30,2) for k,v in m.items() if k.startswith('mlx') and v})"
kill $pid; wait $pid
grep -E "warm-up|slow engine step|budget" "$out/server.log" | cut -c1-400

#!/usr/bin/env bash
# The package as a user gets it: builds the sdist and, from it, the wheel (`python -m build`), installs the wheel
# into a fresh virtual environment outside the checkout, starts `mlxhost serve` (the embedded demo model) from a
# folder outside the checkout and asks it for its pages and one answer per front door. Every install elsewhere is
# editable, so a run-time file left out of the package data would fail here first, not for the first user.
# usage: bash tools/check-wheel.sh  (from anywhere; exits non-zero on the first failure)
# Env: PYTHON (the interpreter whose base installation builds the venvs, default python3),
# READY_S (how long the server may take to answer /health, default 300), KEEP=1 (keep the temp folder).
set -euo pipefail
export HF_HUB_OFFLINE=1 PYTHONNOUSERSITE=1 PIP_DISABLE_PIP_VERSION_CHECK=1
unset PYTHONPATH  # nothing from the checkout may be importable
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
started=$SECONDS
ready_s=${READY_S:-300}

# The base interpreter, not a venv's: a venv made from a project venv could see its editable install.
base=$("${PYTHON:-python3}" -c 'import sys; print(getattr(sys, "_base_executable", None) or sys.executable)')
tmp=$(mktemp -d "${TMPDIR:-/tmp}/mlxhost-wheel.XXXXXX")
case "$tmp" in "$repo"/*) echo "check-wheel: FAIL: temp folder $tmp is inside the checkout" >&2; exit 1 ;; esac
server_pid=

stop_server() {  # SIGINT to the server's process group, a bounded wait, then SIGKILL; returns 1 if it had to kill
  [ -n "$server_pid" ] || return 0
  local pid=$server_pid i
  server_pid=
  kill -INT -- "-$pid" 2> /dev/null || return 0
  for i in $(seq 1 60); do
    kill -0 "$pid" 2> /dev/null || { wait "$pid" 2> /dev/null || true; return 0; }
    sleep 0.5
  done
  kill -KILL -- "-$pid" 2> /dev/null || true
  wait "$pid" 2> /dev/null || true
  return 1
}
cleanup() {
  stop_server || true
  if [ "${KEEP:-0}" = 1 ]; then echo "check-wheel: kept $tmp"; else rm -rf "$tmp"; fi
}
trap cleanup EXIT
trap 'exit 130' INT TERM
fail() {
  echo "check-wheel: FAIL: $*" >&2
  if [ -s "$tmp/server.log" ]; then echo "--- last lines of the server's log" >&2; tail -n 30 "$tmp/server.log" >&2; fi
  exit 1
}
step() { echo "check-wheel: $* ($((SECONDS - started)) s)"; }

step "building the sdist, then the wheel from it, with $base"
"$base" -m venv "$tmp/build-env" || fail "could not create a virtual environment with $base"
"$tmp/build-env/bin/pip" install -q build > "$tmp/build.log" 2>&1 || { tail -n 20 "$tmp/build.log" >&2; fail "pip install build"; }
# Without --sdist/--wheel, build makes the sdist and then the wheel out of the unpacked sdist: both are checked.
"$tmp/build-env/bin/python" -m build --outdir "$tmp/dist" "$repo" > "$tmp/build.log" 2>&1 \
  || { tail -n 30 "$tmp/build.log" >&2; fail "python -m build (log above)"; }
wheel=$(ls "$tmp"/dist/mlxhost-*.whl 2> /dev/null | head -n 1 || true)
sdist=$(ls "$tmp"/dist/mlxhost-*.tar.gz 2> /dev/null | head -n 1 || true)
[ -n "$wheel" ] && [ -n "$sdist" ] || fail "no wheel or no sdist in $tmp/dist"

# The checkout's run-time files besides the code: every one of them must be in the wheel.
if git -C "$repo" rev-parse --git-dir > /dev/null 2>&1; then
  git -C "$repo" ls-files -- src/mlxhost > "$tmp/source-files"
else
  (cd "$repo" && find src/mlxhost -type f ! -path '*/__pycache__/*') > "$tmp/source-files"
fi
"$tmp/build-env/bin/python" - "$wheel" "$sdist" "$tmp/source-files" << 'EOF' || fail "the wheel lacks files (above)"
import os, sys, tarfile, zipfile

wheel, sdist, listing = sys.argv[1:]
names = zipfile.ZipFile(wheel).namelist()
print(f"wheel: {os.path.basename(wheel)}, {os.path.getsize(wheel) / 1e3:.0f} kB, {len(names)} files")
print(f"sdist: {os.path.basename(sdist)}, {os.path.getsize(sdist) / 1e3:.0f} kB, "
      f"{len(tarfile.open(sdist).getnames())} entries")
print("wheel's non-.py files:")
for name in names:
    if not name.endswith(".py"):
        print("  " + name)
wanted = {line.strip()[len("src/"):] for line in open(listing) if line.strip() and not line.strip().endswith(".py")}
missing = sorted(wanted - set(names))
for name in missing:
    print(f"missing from the wheel: {name} (declare it in pyproject.toml's [tool.setuptools.package-data])")
sys.exit(1 if missing else 0)
EOF

step "installing the wheel and its dependencies into a fresh virtual environment"
"$base" -m venv "$tmp/env" || fail "could not create a virtual environment with $base"
"$tmp/env/bin/pip" install -q "$wheel" > "$tmp/install.log" 2>&1 \
  || { tail -n 30 "$tmp/install.log" >&2; fail "pip install of the wheel (log above)"; }
mkdir -p "$tmp/run"
cd "$tmp/run"
where=$("$tmp/env/bin/python" -c 'import mlxhost; print(mlxhost.__file__)') || fail "import mlxhost"
case "$where" in "$tmp/env/"*) ;; *) fail "mlxhost imports from $where, not from the fresh environment" ;; esac
cli_version=$("$tmp/env/bin/mlxhost" --version) || fail "mlxhost --version"
echo "mlxhost --version: $cli_version"

port=$("$tmp/env/bin/python" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
step "starting mlxhost serve (demo model) on 127.0.0.1:$port"
# Its own process group (job control): SIGINT then reaches it and anything it starts, and the background job
# does not inherit the ignored SIGINT a script's `&` would give it. Its caches (the demo model) stay in $tmp.
set -m
XDG_CACHE_HOME="$tmp/cache" "$tmp/env/bin/mlxhost" serve --host 127.0.0.1 --port "$port" \
  < /dev/null > "$tmp/server.log" 2>&1 &
server_pid=$!
set +m

"$tmp/env/bin/python" - "$port" "$server_pid" "$ready_s" "$cli_version" "${wheel##*/}" << 'EOF' || fail "a check failed (above)"
import json, os, sys, time, urllib.error, urllib.request

port, pid, ready_s, cli_version, wheel = sys.argv[1], int(sys.argv[2]), float(sys.argv[3]), sys.argv[4], sys.argv[5]
base = f"http://127.0.0.1:{port}"
opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # 127.0.0.1 only, never a proxy


def ask(path, body=None, timeout=120):
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(base + path, data=data, headers={"Content-Type": "application/json"})
    try:
        with opener.open(request, timeout=timeout) as response:
            return response.status, response.read().decode("utf-8", "replace")
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode("utf-8", "replace")


deadline = time.monotonic() + ready_s
while True:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        sys.exit("the server exited before answering /health")
    try:
        if ask("/health", timeout=5)[0] == 200:
            break
    except OSError:
        pass
    if time.monotonic() > deadline:
        sys.exit(f"no answer from /health within {ready_s:.0f} s")
    time.sleep(1)

failed = []


def check(what, status, ok, detail):
    print(f"  {'ok  ' if status == 200 and ok else 'FAIL'} {what}: {status} {detail}")
    if not (status == 200 and ok):
        failed.append(what)


status, text = ask("/health")
check("GET /health", status, '"ok"' in text, text[:60])
status, text = ask("/version")
version = json.loads(text).get("version") if status == 200 else None
check("GET /version", status, bool(version) and f"mlxhost {version} " in cli_version + " "
      and f"-{version}-" in wheel, f"{text[:60]} (--version and the wheel's name agree)")
status, text = ask("/")
check("GET /", status, "<title>mlxhost</title>" in text, f"{len(text)} chars of HTML")
for path in ("/static/app.js", "/static/style.css"):  # the web page's files: package data
    status, text = ask(path)
    check(f"GET {path}", status, len(text) > 100, f"{len(text)} chars")
status, text = ask("/docs")
check("GET /docs", status, "swagger-ui" in text.lower(), "Swagger UI page")
status, text = ask("/docs/static/swagger-ui-bundle.js")  # served locally from fastapi-offline's files
check("GET /docs/static/swagger-ui-bundle.js", status, len(text) > 100_000, f"{len(text)} chars")
status, text = ask("/v1/models")
models = [m["id"] for m in json.loads(text).get("data", [])] if status == 200 else []
check("GET /v1/models", status, bool(models), f"{models}")
status, text = ask("/v1/chat/completions", {"model": models[0] if models else "default", "max_tokens": 4,
                                            "messages": [{"role": "user", "content": "Say hi"}]})
reply = json.loads(text) if status == 200 else {}
choices = reply.get("choices") or []
check("POST /v1/chat/completions", status, bool(choices) and "message" in choices[0],
      f"{reply.get('usage', {}).get('completion_tokens')} tokens, "
      f"finish_reason {choices[0].get('finish_reason') if choices else None}")
status, text = ask("/api/tags")
tags = json.loads(text).get("models") if status == 200 else None
check("GET /api/tags", status, bool(tags), f"{[t.get('name') for t in tags or []]}")
sys.exit(f"{len(failed)} of the checks failed: {', '.join(failed)}" if failed else 0)
EOF

step "stopping the server (SIGINT)"
stop_server || fail "the server did not stop within 30 s of SIGINT"
step "passed"

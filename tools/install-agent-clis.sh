#!/usr/bin/env bash
# Installs the agent CLIs (and the reference MCP server) pinned in tests/external/clients.txt into one prefix (default
# ~/.cache/mlxhost/agent-clis, or MLXHOST_AGENT_CLIS): npm packages with `npm install -g --prefix`, each PyPI
# package in a venv of its own (aider pins many packages). Commands land in PREFIX/bin. Idempotent: a client
# already at its pinned version is left alone, so CI can cache PREFIX between runs.
# Usage: tools/install-agent-clis.sh [COMMAND...]   (default: every client in the list)
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
prefix="${MLXHOST_AGENT_CLIS:-$HOME/.cache/mlxhost/agent-clis}"
python="${PYTHON:-python3}"
mkdir -p "$prefix/bin" "$prefix/venvs"

wanted() {  # no arguments: every client; otherwise only the commands named
    [ $# -eq 1 ] && return 0
    local cmd="$1"; shift
    for w in "$@"; do [ "$w" = "$cmd" ] && return 0; done
    return 1
}

npm_version() {  # the installed version of an npm package in the prefix, or nothing
    local manifest="$prefix/lib/node_modules/$1/package.json"
    [ -f "$manifest" ] && node -p "require('$manifest').version" 2>/dev/null || true
}

while read -r registry package version command; do
    case "$registry" in ''|'#'*) continue ;; esac
    wanted "$command" "$@" || continue
    case "$registry" in
    npm)
        if [ "$(npm_version "$package")" = "$version" ] && [ -e "$prefix/bin/$command" ]; then
            echo "$command: $package $version already installed"
            continue
        fi
        echo "$command: installing $package@$version"
        npm install -g --prefix "$prefix" --no-audit --no-fund --loglevel=error "$package@$version"
        ;;
    pypi)
        venv="$prefix/venvs/$command"
        stamp="$venv/.mlxhost-pinned"
        if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$package==$version" ] && [ -x "$venv/bin/$command" ]; then
            echo "$command: $package $version already installed"
        else
            echo "$command: installing $package==$version in its own venv"
            rm -rf "$venv"
            "$python" -m venv "$venv"
            "$venv/bin/pip" install --quiet "$package==$version"
            echo "$package==$version" > "$stamp"
        fi
        ln -sf "$venv/bin/$command" "$prefix/bin/$command"
        ;;
    *)
        echo "unknown registry '$registry' in clients.txt" >&2
        exit 2
        ;;
    esac
done < "$root/tests/external/clients.txt"
echo "agent CLIs in $prefix/bin"

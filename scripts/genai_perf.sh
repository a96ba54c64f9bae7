#!/usr/bin/env bash
# genai-perf 0.0.16 against a pdchat server or router, offline, with the model's own tokenizer.
#   scripts/genai_perf.sh triton HOST:GRPC_PORT      # the `chat` model, text_input convention, gRPC streaming
#   scripts/genai_perf.sh openai http://HOST:PORT    # the router's OpenAI endpoint (--endpoint-type chat)
# Extra arguments go to genai-perf (e.g. --concurrency 4). genai-perf needs numpy 2, the
# python backend numpy 1: it gets a venv of its own (.venv-genai-perf); perf_analyzer comes
# from pdchat's venv (the pinned tritonclient carries one that runs here).
set -euo pipefail
cd "$(dirname "$0")/.."
mode=${1:?triton or openai}; url=${2:?address}; shift 2
GP=.venv-genai-perf
if [ ! -x "$GP/bin/genai-perf" ]; then
  echo "[genai-perf] creating $GP (once)" >&2
  python3 -m venv "$GP" && "$GP/bin/pip" install -q "genai-perf==0.0.16"
fi
MODEL=${PDCHAT_MODEL:-tiny}
TOKENIZER=$(.venv/bin/pdchat prepare "$MODEL")
# perf_analyzer loads libcudart.so.12 even on CPU: the PyPI runtime's directory, as benchmarks/perf.py does.
LD_LIBRARY_PATH=$(.venv/bin/python -c 'from benchmarks.perf import perf_analyzer_env; print(perf_analyzer_env()["LD_LIBRARY_PATH"])')
export PATH="$PWD/.venv/bin:$PATH" LD_LIBRARY_PATH HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
common=(--tokenizer "$TOKENIZER" --streaming --synthetic-input-tokens-mean 256 --output-tokens-mean 64
        --request-count 32 --warmup-request-count 4 --artifact-dir bench-results/genai-perf-"$mode")
if [ "$mode" = triton ]; then
  exec "$GP/bin/genai-perf" profile -m chat --endpoint-type kserve --backend tensorrtllm --url "$url" "${common[@]}" "$@"
fi
served=$(curl -s "$url/v1/models" | python3 -c 'import json,sys; print(json.load(sys.stdin)["data"][0]["id"])')
# (The text_input convention has no ignore_eos; the OpenAI body does.)
exec "$GP/bin/genai-perf" profile -m "$served" --endpoint-type chat --url "$url" --extra-inputs ignore_eos:true "${common[@]}" "$@"

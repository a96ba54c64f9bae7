"""vLLM's engine (AsyncLLM) behind pdchat's engine seam (core.engine_api): setting engine=vllm."""

# The README's commands. Each sets up a fresh machine first (idempotent).
.PHONY: setup demo test test-faults test-vllm lint

setup:
	./scripts/bootstrap.sh

demo: setup
	.venv/bin/pdchat demo

lint: setup
	.venv/bin/ruff check .
	.venv/bin/ruff format --check .

# Everything but the fault tests (marker `faults`) and engine=vllm's (marker `vllm`): they run
# apart, in `make test-faults` and `make test-vllm`.
test: lint
	.venv/bin/python -m pytest -q --durations=15 -m "not faults and not vllm"

# kill -9, SIGSTOP and SIGTERM of servers under load, supervised restarts, a cut network link.
test-faults: setup
	.venv/bin/python -m pytest -q --durations=10 -m "faults and not vllm"

# Servers on vLLM's engine (setting engine=vllm), their models run in .venv-vllm (vLLM's CPU build).
test-vllm:
	./scripts/bootstrap.sh --vllm
	.venv/bin/python -m pytest -q --durations=10 -m vllm

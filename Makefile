# The README's commands. Each sets up a fresh machine first (idempotent).
.PHONY: setup demo test test-faults lint

setup:
	./scripts/bootstrap.sh

demo: setup
	.venv/bin/pdchat demo

lint: setup
	.venv/bin/ruff check .
	.venv/bin/ruff format --check .

# Everything but the fault tests (marker `faults`): they run apart, in `make test-faults`.
test: lint
	.venv/bin/python -m pytest -q --durations=15 -m "not faults"

# kill -9, SIGSTOP and SIGTERM of servers under load, supervised restarts, a cut network link.
test-faults: setup
	.venv/bin/python -m pytest -q --durations=10 -m faults

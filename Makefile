# The two commands of the README. Both set up a fresh machine first (idempotent).
.PHONY: setup demo test lint

setup:
	./scripts/bootstrap.sh

demo: setup
	.venv/bin/pdchat demo

lint: setup
	.venv/bin/ruff check .
	.venv/bin/ruff format --check .

test: lint
	.venv/bin/python -m pytest -q --durations=15

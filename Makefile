# The two commands of the README. Both set up a fresh machine first (idempotent).
.PHONY: setup demo test

setup:
	./scripts/bootstrap.sh

demo: setup
	.venv/bin/pdchat demo

test: setup
	.venv/bin/python -m pytest -q

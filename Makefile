# The two commands a new user runs: `make serve` and `make test`. Both set up .venv first (idempotent).
.PHONY: setup serve generate test lint bench

setup:
	scripts/setup.sh

serve: setup
	.venv/bin/conveyor serve

generate: setup
	.venv/bin/conveyor generate "$(PROMPT)"

test: setup
	.venv/bin/python -m pytest -q --durations=25

lint: setup
	.venv/bin/ruff check .

bench: setup
	.venv/bin/python benchmarks/offline.py

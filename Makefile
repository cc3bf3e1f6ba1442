# The two commands a new user runs: `make serve` and `make test`. Both set up .venv first (idempotent).
.PHONY: setup serve generate test test-fast lint docs bench

setup:
	scripts/setup.sh

serve: setup
	.venv/bin/conveyor serve

generate: setup
	.venv/bin/conveyor generate "$(PROMPT)"

test: setup
	.venv/bin/python -m pytest -q --durations=25

# The inner loop: every test that starts no Ray and is not slow (markers `ray`, `slow`: tests/conftest.py,
# pyproject.toml); `make test` runs them all.
test-fast: setup
	.venv/bin/python -m pytest -q -m "not ray and not slow" --durations=10

lint: setup
	.venv/bin/ruff check .

# docs/configuration.md from the settings' one source (tests/router/test_config_sources.py checks it is current).
docs: setup
	.venv/bin/python scripts/config_docs.py > docs/configuration.md

bench: setup
	.venv/bin/python -m benchmarks.offline

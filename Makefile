# The two commands of the README. Both set up first (scripts/setup.sh, idempotent).
VENV ?= .venv
PY := $(VENV)/bin/python
DEMO_DIR ?= demo-swap

.PHONY: setup demo test clean

setup:
	@bash scripts/setup.sh

# Trains a small GPT-2 with params, grads and optimizer all on NVMe under ./demo-swap,
# then shows what is on disk (swap-inspect). DEMO_ARGS passes options (python -m infinity.tools.demo --help).
demo: setup
	$(PY) -m infinity.tools.demo --swap-dir $(DEMO_DIR) $(DEMO_ARGS)

test: setup
	$(PY) -m pytest $(PYTEST_ARGS)

clean:
	rm -rf build *.egg-info aio/_uring*.so $(DEMO_DIR) bench-data

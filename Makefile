# The two commands of the README. Both set up first (scripts/setup.sh, idempotent).
VENV ?= .venv
PY := $(VENV)/bin/python
DEMO_DIR ?= demo-swap

.PHONY: setup demo test clean

setup:
	@bash scripts/setup.sh

# Trains a 25M-parameter GPT-2 (381 MiB of fp32 training state) in a 46 MiB host budget with
# params, grads and optimizer all on NVMe under ./demo-swap, prints the state against the budget
# and the peak RSS growth, saves it (save_pretrained) and streams it back (from_pretrained), then
# shows what is on disk (swap-inspect). A few minutes on 2 cores. DEMO_ARGS passes options
# (python -m infinity.tools.demo --help).
demo: setup
	$(PY) -m infinity.tools.demo --swap-dir $(DEMO_DIR) $(DEMO_ARGS)

test: setup
	$(PY) -m pytest $(PYTEST_ARGS)

clean:
	rm -rf build *.egg-info aio/_uring*.so infinity/_compact_native*.so $(DEMO_DIR) bench-data

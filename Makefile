# The two commands of the README. Both set up first (scripts/setup.sh, idempotent).
VENV ?= .venv
PY := $(VENV)/bin/python
DEMO_DIR ?= bench-data

.PHONY: setup demo test clean

setup:
	@bash scripts/setup.sh

demo: setup
	@mkdir -p $(DEMO_DIR)
	$(VENV)/bin/nvme-bench $(DEMO_DIR) --quick

test: setup
	$(PY) -m pytest $(PYTEST_ARGS)

clean:
	rm -rf build *.egg-info aio/_uring*.so $(DEMO_DIR)

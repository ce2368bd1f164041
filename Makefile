# Two entry points for a newcomer: `make demo` and `make test`. Both bootstrap .venv (the pinned torch from
# pyproject.toml) and the CMake build, and reuse them on the next run.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
BUILD := build
TORCH_PIN := $(shell grep -o 'torch==[0-9.]*' pyproject.toml | head -1)

.PHONY: demo test test-quick op-sweep op-sweep-update module-sweep module-sweep-update build venv zoo-deps system-deps cpp-test py-test bench zoo clean

# Each stage says what it does, how long it roughly takes on 2 cores, and how long it took.
# A stage's recipe starts with  @echo "== <what, and how long it roughly takes>"; date +%s > .stage-start
STAGE_DONE = @echo "   done in $$(( $$(date +%s) - $$(cat .stage-start 2>/dev/null || date +%s) )) s"; rm -f .stage-start

venv: $(VENV)/.stamp $(VENV)/.test-stamp $(VENV)/.zoo-stamp
$(VENV)/.stamp: pyproject.toml
	@echo "== creating $(VENV): $(TORCH_PIN) and the build tools (downloads torch and its CUDA libraries, ~3 GB: a few minutes on a fast link)"; date +%s > .stage-start
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install --progress-bar on "$(TORCH_PIN)" numpy pytest matplotlib tqdm ninja "cmake>=3.25" scikit-build-core
	touch $@
	$(STAGE_DONE)

# Test dependencies (tests/requirements.txt), on the torch pin's pip line.
$(VENV)/.test-stamp: tests/requirements.txt | $(VENV)/.stamp
	$(PY) -m pip install -q "$(TORCH_PIN)" -r tests/requirements.txt
	touch $@

# Optional: the model zoo's libraries (timm, MONAI, smp, diffusers, neuraloperator, PhysicsNeMo, transformers,
# torch-harmonics), tried once, on the same pip line as the torch pin so torch stays pinned. A failure is reported
# and recorded, never fatal: the zoo tests then skip naming the missing library. `make zoo-deps` tries again.
# Packages whose own pins contradict the zoo's (nnU-Net's dynamic-network-architectures asks timm < 1.0.23) go in
# a second file, installed without their dependencies (the zoo's models from them need none it lacks).
ZOO_REQS := tests/requirements-zoo.txt
ZOO_NODEPS := tests/requirements-zoo-nodeps.txt
$(VENV)/.zoo-stamp: $(ZOO_REQS) $(ZOO_NODEPS) | $(VENV)/.stamp
	@echo "== optional test dependencies: $(ZOO_REQS) (pinned against $(TORCH_PIN)); about a minute"; date +%s > .stage-start
	@if $(PY) -m pip install -q "$(TORCH_PIN)" -r $(ZOO_REQS) && \
	    $(PY) -m pip install -q --no-deps -r $(ZOO_NODEPS); then echo ok > $@; else \
	  echo "failed: the zoo tests will skip; \`make zoo-deps\` retries" | tee $@; fi
	$(STAGE_DONE)

zoo-deps: | $(VENV)/.stamp
	rm -f $(VENV)/.zoo-stamp
	$(MAKE) $(VENV)/.zoo-stamp

# Best effort, as root on Debian: GoogleTest and Google Benchmark for the C++ tests and benchmark, gloo's
# headers so C++ programs can create Gloo groups (the torch wheel ships none). Missing ones are skipped.
SYSTEM_DEPS := /usr/include/gtest/gtest.h:libgtest-dev /usr/include/benchmark/benchmark.h:libbenchmark-dev /usr/include/gloo/algorithm.h:libgloo-dev
system-deps:
	@missing=""; for d in $(SYSTEM_DEPS); do [ -f "$${d%%:*}" ] || missing="$$missing $${d##*:}"; done; \
	if [ -n "$$missing" ]; then \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	    echo "installing$$missing"; apt-get install -y -q $$missing >/dev/null 2>&1 || \
	    (apt-get update -q >/dev/null 2>&1 && apt-get install -y -q $$missing >/dev/null 2>&1) || \
	    echo "could not install$$missing; the parts that need them are skipped"; \
	  else echo "not installed:$$missing (the parts that need them are skipped)"; fi; fi

build: venv system-deps
	@echo "== building the library, the Python module and the C++ tests (CMake + ninja; [done/total] below): the first build about 5 minutes on 2 cores, later ones seconds"; date +%s > .stage-start
	@if [ ! -f $(BUILD)/build.ninja ]; then \
	  PATH=$(CURDIR)/$(VENV)/bin:$$PATH cmake -S . -B $(BUILD) -G Ninja -DPython3_EXECUTABLE=$(CURDIR)/$(PY) ; fi
	PATH=$(CURDIR)/$(VENV)/bin:$$PATH cmake --build $(BUILD)
	$(STAGE_DONE)
	@# The source tree's package is importable from the venv (the build drops _C and libshardtensor into it).
	@echo "$(CURDIR)/python" > $$($(PY) -c 'import sysconfig;print(sysconfig.get_paths()["purelib"])')/shardtensor-dev.pth

demo: build
	@echo "== the demo: a tiny ViT on a height-sharded image, 2 CPU ranks against one process (under a minute)"; date +%s > .stage-start
	$(PY) examples/python/demo.py
	$(STAGE_DONE)

cpp-test: build
	cd $(BUILD) && ctest --output-on-failure

py-test: build
	$(PY) -m pytest -q tests/python

test: build
	@echo "== C++ tests: GoogleTest, the CMake package, the README's C++ recipe, the CUDA sources compiling (a few minutes)"; date +%s > .stage-start
	cd $(BUILD) && ctest --output-on-failure
	$(STAGE_DONE)
	@echo "== Python tests (pytest; about a quarter of an hour on 2 cores)"; date +%s > .stage-start
	$(PY) -m pytest -q tests/python
	$(STAGE_DONE)

# The quick tier (docs/testing.md): the GoogleTests and one representative pytest case per test file, ~3 minutes.
test-quick: build
	cd $(BUILD) && ctest --output-on-failure -LE "package|cuda"
	$(PY) -m pytest -q -m quick tests/python

# The whole OpInfo sweep (tests/python/op_sweep.py; `make test` runs a subset): compare with the expected file, or
# rewrite it and the generated op list of docs/supported-ops.md.
op-sweep: build
	$(PY) tests/python/op_sweep.py --check

op-sweep-update: build
	$(PY) tests/python/op_sweep.py --update

# The whole ModuleInfo sweep (tests/python/module_sweep.py; `make test` runs a subset), likewise.
module-sweep: build
	$(PY) tests/python/module_sweep.py --check

module-sweep-update: build
	$(PY) tests/python/module_sweep.py --update

bench: build
	$(PY) benchmarks/dispatch_overhead/bench.py

# The model zoo's pass/raise/wrong table (benchmarks/zoo/README.md); into benchmarks/results/local/ by default.
zoo: build
	$(PY) benchmarks/zoo/bench.py $(ZOO_ARGS)

clean:
	rm -rf $(BUILD) python/shardtensor/_C*.so python/shardtensor/lib

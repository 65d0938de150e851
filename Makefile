# The two commands a newcomer needs: `make demo` and `make test`.
PYTHON ?= python3
VENV := .venv
VPY := $(VENV)/bin/python
PIP := $(VPY) -m pip -q
CONSTRAINTS := .ci/constraints.txt
BUILD_DEPS := scikit-build-core pybind11 ninja
TEST_DEPS := pytest hypothesis regex megatron-core tiktoken tokenizers matplotlib vermin mypy
BENCH_DEPS := tokenizers tiktoken rustbpe
# The newest megatron-core lives in a side directory (two releases cannot share one process); the
# bucket tests and benchmark run it in a subprocess with this on PYTHONPATH.
MEGATRON_NEWEST := $(VENV)/megatron-newest
export TRAINFAST_MEGATRON_NEWEST := $(abspath $(MEGATRON_NEWEST))

.PHONY: demo test bench install dev fuzz test-sanitize clean megatron-newest

$(VENV)/.deps: pyproject.toml $(CONSTRAINTS)
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -c $(CONSTRAINTS) torch==2.13.0
	$(PIP) install -c $(CONSTRAINTS) numpy tqdm $(BUILD_DEPS) $(TEST_DEPS)
	touch $@

$(MEGATRON_NEWEST)/.stamp: .ci/megatron-newest.txt | $(VENV)/.deps
	rm -rf $(MEGATRON_NEWEST)
	$(PIP) install --no-deps --ignore-requires-python --target $(MEGATRON_NEWEST) -r .ci/megatron-newest.txt
	touch $@

# Non-editable install, incremental through scikit-build-core's build dir (build/).
install: $(VENV)/.deps
	$(PIP) install --no-build-isolation --no-deps -c $(CONSTRAINTS) .

demo: install
	$(VENV)/bin/trainfast demo

test: install $(MEGATRON_NEWEST)/.stamp
	$(VPY) -m pytest tests

fuzz: install
	HYPOTHESIS_PROFILE=fuzz $(VPY) -m pytest tests -m "not slow" -x

bench: install $(MEGATRON_NEWEST)/.stamp
	$(PIP) install -c $(CONSTRAINTS) $(BENCH_DEPS)
	set -e; for b in benchmarks/bench_*.py; do $(VPY) $$b --write-readme; done

megatron-newest: $(MEGATRON_NEWEST)/.stamp

# Fast inner loop for developers: build the extension in place, then `PYTHONPATH=python pytest`.
# Installs the .so under a temp name, then renames it (a new inode): overwriting a loaded .so in
# place crashes the Python that has it mapped.
dev: $(VENV)/.deps
	cmake -S . -B build/dev -G Ninja -DCMAKE_BUILD_TYPE=Release \
	  -Dpybind11_DIR=$$($(VPY) -c 'import pybind11; print(pybind11.get_cmake_dir())') \
	  -DPython_EXECUTABLE=$$(realpath $(VPY)) >/dev/null
	cmake --build build/dev
	for so in build/dev/_core*.so; do cp "$$so" "python/trainfast/.$${so##*/}.tmp" && mv -f "python/trainfast/.$${so##*/}.tmp" "python/trainfast/$${so##*/}"; done

# The whole suite against an extension built with -fsanitize=address,undefined (no recovery).
SAN_DIR := build/sanitize
SAN_ENV := LD_PRELOAD="$$(gcc -print-file-name=libasan.so) $$(gcc -print-file-name=libubsan.so)" \
	ASAN_OPTIONS=detect_leaks=0:abort_on_error=1 UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1 \
	PYTHONPATH=$(SAN_DIR)/pkg
test-sanitize: $(VENV)/.deps $(MEGATRON_NEWEST)/.stamp
	cmake -S . -B $(SAN_DIR) -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DTRAINFAST_SANITIZE=ON \
	  -Dpybind11_DIR=$$($(VPY) -c 'import pybind11; print(pybind11.get_cmake_dir())') \
	  -DPython_EXECUTABLE=$$(realpath $(VPY)) >/dev/null
	cmake --build $(SAN_DIR)
	rm -rf $(SAN_DIR)/pkg && mkdir -p $(SAN_DIR)/pkg && cp -r python/trainfast $(SAN_DIR)/pkg/
	rm -f $(SAN_DIR)/pkg/trainfast/_core*.so && cp $(SAN_DIR)/_core*.so $(SAN_DIR)/pkg/trainfast/
	$(SAN_ENV) $(VPY) -m pytest tests $(SANITIZE_PYTEST_ARGS)

clean:
	rm -rf build $(VENV) python/trainfast/_core*.so

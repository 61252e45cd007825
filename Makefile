# Two supported stacks, one public API (README "Which stack"):
#   Stack A (Keras 2): Python 3.11, TensorFlow 2.15, tensorflow-privacy 0.9.0:
#     constraints.txt -> .venv
#   Stack B (Keras 3): Python 3.12, TensorFlow 2.21, Keras 3.15, numpy 2:
#     constraints-keras3.txt -> .venv-keras3
# `make test` and `make demo` work on a fresh machine with only Python and
# PyPI: the first call builds the virtualenv(s) from the constraints files.
PYTHON ?= $(shell command -v python3.11 || command -v python3)
# python3.12 on the PATH, else pyenv's (its shims answer only for the
# versions pyenv has selected).
PYTHON_KERAS3 ?= $(shell for p in python3.12 $$(pyenv root 2>/dev/null)/versions/3.12*/bin/python3.12; do \
  $$p -c 'import sys; assert sys.version_info[:2] == (3, 12)' 2>/dev/null && { command -v $$p; break; }; done)
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.tfdpx-installed
VENV3 := .venv-keras3
PY3 := $(VENV3)/bin/python
STAMP3 := $(VENV3)/.tfdpx-installed

.PHONY: venv venv-keras3 test test-keras2 test-onednn-off test-keras3 test-all \
  test-all-keras3 demo demo-keras3 bench bench-keras3 audit audit-keras3 clean

venv: $(STAMP)

$(STAMP): constraints.txt setup.cfg pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -c constraints.txt -e '.[test,examples]'
	touch $(STAMP)

venv-keras3: $(STAMP3)

$(STAMP3): constraints-keras3.txt setup.cfg pyproject.toml
	@test -n "$(PYTHON_KERAS3)" || { echo "Stack B needs Python 3.12 (set PYTHON_KERAS3)"; exit 1; }
	test -x $(PY3) || $(PYTHON_KERAS3) -m venv $(VENV3)
	$(PY3) -m pip install --quiet --upgrade pip
	$(PY3) -m pip install --quiet -c constraints-keras3.txt -e '.[test,examples]'
	touch $(STAMP3)

# Both suites; Stack B is skipped, with the reason, only where Python 3.12
# is missing. Two test processes each (pytest-xdist): the suites are mostly
# single-threaded Python and graph tracing, and CI has two cores. Each run
# lists its slowest tests: the suite's time is every session's iteration time.
DURATIONS := --durations=25
test: test-keras2 test-onednn-off
	@if [ -n "$(PYTHON_KERAS3)" ]; then $(MAKE) --no-print-directory test-keras3; \
	else echo "SKIPPED the Keras 3 suite (Stack B): no Python 3.12 found (set PYTHON_KERAS3)"; fi

test-keras2: $(STAMP)
	$(PY) -m pytest -m "not slow" -q -n 2 $(DURATIONS)

# The convolution tests again on TensorFlow's own CPU kernels, as on CPUs
# where TensorFlow leaves oneDNN off (AMD, AVX2 only). oneDNN replaces the
# convolution, pooling, matmul and batch-norm kernels; the convolution family
# is where the arguments they accept differ (a depthwise convolution's unequal
# strides), the others differ only in rounding. Stack A; the full suites run
# with the machine's default.
ONEDNN_OFF_TESTS := tests/test_per_example.py tests/test_engine_equivalence.py \
  tests/keras/test_pipelines.py::test_strided_convolutions_train_from_a_dataset_of_unknown_batch_size \
  tests/keras/test_pipelines.py::test_strided_convolution_statistics_equal_single_example_tapes \
  tests/keras/test_models.py \
  tests/keras/test_zoo.py::test_statistics_equal_single_example_tapes
ONEDNN_OFF_MODELS := conv or depthwise or separable or pool or cnn or strided \
  or group_norm or augmentation or frozen_backbone or timeseries

test-onednn-off: $(STAMP)
	TF_ENABLE_ONEDNN_OPTS=0 $(PY) -m pytest -m "not slow" -q -n 2 \
	  -k "$(ONEDNN_OFF_MODELS)" $(ONEDNN_OFF_TESTS)

test-keras3: $(STAMP3)
	$(PY3) -m pytest -m "not slow" -q -n 2 $(DURATIONS)

test-all: $(STAMP)
	$(PY) -m pytest -q -n 2

test-all-keras3: $(STAMP3)
	$(PY3) -m pytest -q -n 2

demo: $(STAMP)
	$(PY) -m examples.demo

demo-keras3: $(STAMP3)
	$(PY3) -m examples.demo

# BENCH_FLAGS: e.g. --models=cnn,mlp --pipeline=tfdata,tfdata_drop
# --memory_models=cnn (benchmarks/speed.py; default pipelines tfdata, poisson).
bench: $(STAMP)
	$(PY) -m benchmarks.speed $(BENCH_FLAGS)

bench-keras3: $(STAMP3)
	$(PY3) -m benchmarks.speed $(BENCH_FLAGS)

# AUDIT_FLAGS: e.g. --epsilons=16 --repetitions=3 (python -m tfdpx.audit).
audit: $(STAMP)
	$(PY) -m tfdpx.audit $(AUDIT_FLAGS)

audit-keras3: $(STAMP3)
	$(PY3) -m tfdpx.audit $(AUDIT_FLAGS)

clean:
	rm -rf $(VENV) $(VENV3) build *.egg-info

# Bazel (docs/bazel.md): Debian's Bazel 4, offline, every test under the .venv Python.
BAZEL ?= bazel-4
SUDO := $(if $(filter 0,$(shell id -u)),,sudo)

.PHONY: bazel-test

bazel-test: $(STAMP)
	command -v $(BAZEL) >/dev/null || { $(SUDO) apt-get update && \
	  $(SUDO) env DEBIAN_FRONTEND=noninteractive apt-get install -y bazel-bootstrap; }
	$(BAZEL) test //...

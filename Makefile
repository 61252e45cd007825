# `make test` and `make demo` work on a fresh machine with only Python 3.11:
# the first call builds .venv from the one constraints file that pins the stack.
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.tfdpx-installed

.PHONY: venv test test-all demo bench clean

venv: $(STAMP)

$(STAMP): constraints.txt setup.cfg pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -c constraints.txt -e '.[test,examples]'
	touch $(STAMP)

# Two test processes (pytest-xdist): the suite is mostly single-threaded
# Python and graph tracing, and CI has two cores.
test: $(STAMP)
	$(PY) -m pytest -m "not slow" -q -n 2

test-all: $(STAMP)
	$(PY) -m pytest -q -n 2

demo: $(STAMP)
	$(PY) -m examples.demo

bench: $(STAMP)
	$(PY) -m benchmarks.speed

clean:
	rm -rf $(VENV) build *.egg-info

# Bazel (docs/bazel.md): Debian's Bazel 4, offline, every test under the .venv Python.
BAZEL ?= bazel-4
SUDO := $(if $(filter 0,$(shell id -u)),,sudo)

.PHONY: bazel-test

bazel-test: $(STAMP)
	command -v $(BAZEL) >/dev/null || { $(SUDO) apt-get update && \
	  $(SUDO) env DEBIAN_FRONTEND=noninteractive apt-get install -y bazel-bootstrap; }
	$(BAZEL) test //...

# The two user-facing targets: `make test` and `make report`.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: test report

# torch first and pinned exactly: a plain `torch` requirement would pull a CUDA build (several GB).
$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e ".[test,report]"
	touch $(STAMP)

# Two workers of one thread each: the suite is compile-bound (one core per compile), and a test module
# stays on one worker (--dist loadfile) so that the compiles it shares are made once.
WORKERS ?= 2

test: $(STAMP)
	$(PY) -m pytest -q -n $(WORKERS) --dist loadfile $(PYTEST_ARGS)

report: $(STAMP)
	$(PY) -m mla_inductor.report $(REPORT_ARGS)

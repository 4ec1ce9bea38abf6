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

test: $(STAMP)
	$(PY) -m pytest -q $(PYTEST_ARGS)

report: $(STAMP)
	$(PY) -m mla_inductor.report $(REPORT_ARGS)

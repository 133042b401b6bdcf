# TorchPass: `make demo` and `make test` are the two commands a new machine needs.
PY ?= python3
VENV := .venv
VPY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
DEVCLUSTER := contrib/devcluster/devcluster

.PHONY: setup deps venv spank test test-matrix unit lint demo clean-cluster

setup: deps venv spank

deps:
	@bash contrib/install/install-deps.sh
	@bash contrib/install/install-criu.sh || echo "[setup] no private criu: the CRIU tests will be skipped (reason above)"
	@bash contrib/install/install-promtool.sh || echo "[setup] no promtool: the alert-rules check will be skipped (reason above)"

venv: $(STAMP)

$(STAMP): pyproject.toml
	@echo "[setup] creating $(VENV) with torch (CPU) and the project"
	@test -x $(VPY) || $(PY) -m venv $(VENV)
	@$(VPY) -m pip install -q --disable-pip-version-check --upgrade pip >/dev/null
	@$(VPY) -m pip install -q --disable-pip-version-check -e '.[test]' > $(VENV)/pip-install.log 2>&1 \
	  || { cat $(VENV)/pip-install.log; echo "[setup] pip install failed (log: $(VENV)/pip-install.log)"; exit 1; }
	@touch $(STAMP)

spank:
	$(MAKE) -s -C spank

lint: venv
	$(VENV)/bin/ruff check .
	$(VENV)/bin/lint-imports

unit: setup
	$(VENV)/bin/pytest tests/unit -q

test: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/lint-imports
	$(VENV)/bin/pytest -q --durations=20

# The long cases CI leaves out: more layouts and modes of what CI tests once, soaks, fuzzing.
test-matrix: setup
	$(VENV)/bin/pytest -q -m "matrix or soak or fuzz" --durations=20

demo: setup
	@$(VPY) -m contrib.demo

clean-cluster:
	-$(DEVCLUSTER) down

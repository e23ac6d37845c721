# One-command setup: `make test` creates .venv when missing, installs the project with
# its test and engine extras, then lints, type-checks and runs the suite.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.kvquota-installed

.PHONY: test demo lint typecheck crds install clean cross-version

$(STAMP): pyproject.toml
	@echo "Setting up $(VENV): kvquota with its test and engine extras (vLLM's CPU build,"
	@echo "torch, transformers; a few minutes). Once only."
	test -x $(PY) || python3 -m venv $(VENV)
	@# pip is quiet (its full output buries errors): an elapsed-time line every 10 s.
	$(PY) -m pip install --quiet --disable-pip-version-check -e '.[test,engine]' & pid=$$!; \
	  start=$$(date +%s); \
	  while kill -0 $$pid 2>/dev/null; do \
	    sleep 10; kill -0 $$pid 2>/dev/null && echo "  ... pip still installing ($$(( $$(date +%s) - start ))s)"; \
	  done; wait $$pid
	# Beside torch 2.13.0+cpu these break `import transformers` (torchvision::nms).
	$(PY) -m pip uninstall --quiet -y torchvision torchaudio torchcodec
	touch $@

install: $(STAMP)

lint: $(STAMP)
	$(PY) -m ruff check .

typecheck: $(STAMP)
	$(PY) -m mypy

crds: $(STAMP)
	$(VENV)/bin/kvquota crds

# Into .cache, once (each step checks its pinned sha256 and is skipped when done):
# vLLM 0.32.0's own tests/v1/core suite plus offline model configs, for the conformance
# run (tests/conformance), and vLLM 0.33.0's Python code, for tests/plugin on 0.33.
cross-version: $(STAMP)
	$(PY) tests/conformance/prepare.py vllm-tests
	$(PY) tests/conformance/prepare.py vllm-0.33

test: $(STAMP) lint typecheck cross-version
	$(VENV)/bin/kvquota crds --check
	$(PY) -m pytest

demo: $(STAMP)
	@echo "kvquota demo: two vLLM engine starts (~40 s each) and two workload runs; about 2.5 minutes"
	$(VENV)/bin/kvquota demo

clean:
	rm -rf $(VENV) .cache .pytest_cache .mypy_cache .ruff_cache

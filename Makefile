# meshserve — run `make help` for the targets.
SHELL := /bin/bash
VENV := .venv
PY := $(VENV)/bin/python
PROMPT ?= What is the capital of France?

.PHONY: help setup proto proto-check lint layering test compose-test test-fast fault fuzz run demo bench bench-load bench-litellm bench-ab bench-report soak clean

help: ## Show this help.
	@grep -hE '^[a-zA-Z_-]+:.*?## ' $(MAKEFILE_LIST) | awk 'BEGIN{FS=":.*?## "}{printf "  %-12s %s\n", $$1, $$2}'

setup: ## Create .venv, install deps, redis-server and prepare the models (idempotent).
	@bash scripts/setup.sh

proto: setup ## Regenerate services/common/pb from protos/.
	$(PY) scripts/gen_protos.py

proto-check: ## Fail if services/common/pb differs from what protos/ generates.
	@tmp=$$(mktemp -d) && $(PY) scripts/gen_protos.py --out $$tmp/pb && \
	  diff -r -x __pycache__ $$tmp/pb services/common/pb && echo "proto-check: generated code is up to date"; \
	  rc=$$?; rm -rf $$tmp; exit $$rc

lint: ## ruff + mypy.
	$(VENV)/bin/ruff check services tests benchmarks scripts
	$(VENV)/bin/ruff format --check services tests benchmarks scripts
	$(VENV)/bin/mypy services benchmarks

layering: ## Import circles, upward imports from services/common, environment reads outside settings, services importing services.cli or services.local, the router's balancer importing its front end (tests/unit/test_import_graph.py holds the known exceptions).
	$(PY) scripts/import_graph.py

test: setup ## Run the whole test suite (unit, integration, e2e) with real Redis and the real model, then compose-test.
	$(MAKE) --no-print-directory proto-check
	$(VENV)/bin/pytest -q -p no:cacheprovider --durations=30
	$(MAKE) --no-print-directory compose-test

compose-test: setup ## The compose deployment in real containers: engine installed/started where it can be (skipped with the reason where not), image built, stack up, checked, down -v.
	@bash scripts/compose_test.sh

test-fast: ## Unit tests only (no setup).
	$(VENV)/bin/pytest -q tests/unit

fault: setup ## Full fault-injection suite (kill -9, Redis outage, slow/stalled worker, gateway restart) at full load.
	MESHSERVE_FAULT_FULL=1 $(VENV)/bin/pytest -q -p no:cacheprovider -m fault tests/fault --timeout=1800

FUZZ_SCALE ?= 30
fuzz: setup ## Long fuzz run (>= 10,000 cases, gRPC + HTTP through Envoy); counts in docs/fuzz_report.json.
	MESHSERVE_FUZZ_SCALE=$(FUZZ_SCALE) MESHSERVE_FUZZ_REPORT=docs/fuzz_report.json \
	  $(VENV)/bin/pytest -q -p no:cacheprovider -m fuzz tests/fuzz --timeout=0

run: setup ## Start the local mesh, stream an answer to a demo prompt, keep serving until Ctrl-C.
	$(VENV)/bin/meshserve up --demo "$(PROMPT)"

demo: setup ## Start the mesh, stream one answer, stop.
	$(VENV)/bin/meshserve up --demo "$(PROMPT)" --exit-after-demo

bench: setup ## Benchmark the mesh; writes docs/benchmarks/.
	$(VENV)/bin/meshserve bench

bench-load: setup ## Closed-loop load with direct-worker and naive-transformers baselines; JSON + PNG in docs/benchmarks/.
	$(VENV)/bin/meshserve bench load --baselines direct,naive
	$(VENV)/bin/meshserve bench report

bench-litellm: ## LiteLLM proxy in its own venv (.venv-litellm; its pins clash with ours), then `bench gateways`.
	@test -x .venv-litellm/bin/litellm || { python3 -m venv .venv-litellm && .venv-litellm/bin/pip install -q "litellm[proxy]"; }
	$(VENV)/bin/meshserve bench gateways

AB_TREE ?= /tmp/before
bench-ab: setup ## hops + relay of this tree and AB_TREE's side by side, one run each (`git worktree add /tmp/before <commit>`).
	@test -d $(AB_TREE)/services || { echo "AB_TREE=$(AB_TREE) is not a meshserve checkout; e.g. git worktree add $(AB_TREE) <commit>"; exit 2; }
	$(PY) -m benchmarks.gateway.hops --ab-tree $(AB_TREE)
	$(VENV)/bin/meshserve bench relay --ab-tree $(AB_TREE)

bench-report: ## Regenerate docs/benchmarks/README.md from the benchmarks' JSON files.
	$(VENV)/bin/meshserve bench report

SOAK_MINUTES ?= 10
soak: setup ## SOAK_MINUTES at 80 % of measured capacity; fails on RSS/fd growth > 5 % (docs/soak.md).
	$(VENV)/bin/meshserve bench soak --minutes $(SOAK_MINUTES)

clean: ## Remove the virtualenv and caches (prepared models stay in ~/.cache/meshserve).
	rm -rf $(VENV) .pytest_cache .ruff_cache .mypy_cache

# Sluice: `make run` brings the suite up and streams a demo; `make test` runs every test.
SHELL := /bin/bash
.DEFAULT_GOAL := help

PYTHON ?= python3
UV_VERSION := 0.13.9
# uv from PATH, else a private copy in .tools (installed on first use).
UV := $(or $(shell command -v uv 2>/dev/null),$(CURDIR)/.tools/bin/uv)
BUF := node_modules/.bin/buf

# How llama-cpp-python (triton-local's engine) compiles: it has no wheel on the registry. Portable
# x86-64 with AVX2 rather than -march=native: some VMs report CPU features (AMX) that they refuse,
# and a native build dies there with "Illegal instruction". Only the library, no tools or llava.
# On a GPU machine: CMAKE_ARGS="-DGGML_CUDA=on" make setup (uv caches the first build it makes:
# `uv cache clean llama-cpp-python` before building with other flags).
export CMAKE_ARGS ?= -DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON \
  -DGGML_AVX512=OFF -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF \
  -DLLAVA_BUILD=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TOOLS=OFF -DLLAMA_BUILD_SERVER=OFF

# Every Python project with its own environment.
SERVICES := services/gateway services/inference-adapter services/triton-local services/evaluation-logging services/rate-limit
LIBS := libs/sluice-protos libs/sluice-common libs/sluice-stack
# The `sluice` command (bin/sluice runs it): a client of the suite, not a service.
CLI := cli
PROJECTS := $(LIBS) $(SERVICES) $(CLI) tests bench deploy/tests docs tools/lint
# What `make lint` type-checks, each in its own environment.
TYPED := libs/sluice-common libs/sluice-stack $(SERVICES) $(CLI)
LINT := $(CURDIR)/tools/lint
UNIT_TESTED := libs/sluice-common $(SERVICES) $(CLI) bench

.PHONY: help docs lint setup prometheus-tools deploy-requirements uv node protos protos-check proto-lint run test test-unit test-e2e test-deploy bench-path bench-tracing bench-adapter bench-evallog bench-ratelimit bench-jobs bench-jobs-interactive bench-engine bench-colocated bench-threads bench-gpu bench-gpu-networked bench-gpu-kit bench-load bench-rolling bench-embed-cache bench-openai bench-peer bench-prefix bench-transport bench-rounds-ahead bench-structured llama-server clean

help:
	@echo "make run        start the whole suite locally and stream a demo completion (Ctrl-C stops it)"
	@echo "make test       lint (ruff, mypy, import contracts), the docs site, proto checks, deploy/ checks, each project's unit tests, then end-to-end tests on the real stack"
	@echo "make docs       build the documentation site (docs/, MkDocs --strict) into build/docs-site; check README.md's links"
	@echo "make bench-engine the step engine vs llama.cpp's own batched decode: prefill and decode tok/s"
	@echo "make bench-colocated two engines on one host: cores split between them vs every core each (tok/s, step p99)"
	@echo "make bench-threads the local stack's engine thread policies (spin, passive, one thread, ggml pool) quiet and beside a busy process"
	@echo "make bench-gpu  on an NVIDIA GPU: the step engine's decode tok/s there vs the CPU at batch 1-64, greedy tokens identical?"
	@echo "                on a borrowed GPU machine with no network: the offline kit's loads, one carried per call (no setup)"
	@echo "make bench-gpu-networked  bench-gpu on a GPU machine with a network: make setup (with CUDA), then the bench"
	@echo "make bench-gpu-kit the offline kit that runs bench-gpu on a borrowed GPU machine: built here, then proved here offline"
	@echo "make bench-load 16, 32 and 64 chat streams through the stack: tok/s, TTFT, vs the engine alone"
	@echo "make bench-rolling gateway, adapter and evaluation-logging restarted one by one under 32 streams: failed streams, lost events, TTFT"
	@echo "make bench-openai a third-party load tool (aiperf) on the OpenAI HTTP front vs the same load over gRPC: TTFT, tok/s"
	@echo "make bench-peer the stack vs llama.cpp's own llama-server on the same GGUF, 2 threads: tok/s and TTFT at 1 and 32 streams"
	@echo "make bench-prefix triton-local's prefix cache on vs off: a shared 1,000-token system prompt, 5-turn chats (TTFT, tok/s)"
	@echo "make bench-transport the step protocol through PyTriton vs Triton's Python backend vs the engine alone (tok/s, CPU per token)"
	@echo "make bench-rounds-ahead the adapter's rounds sent ahead (SLUICE_ADAPTER_ROUNDS_AHEAD) vs after, two stacks side by side"
	@echo "make bench-structured the step engine with a JSON schema constraint vs free generation (tok/s at batch 1 and 8), compile ms, validity over 32 schemas"
	@echo "make llama-server build llama.cpp's llama-server (bench-peer's peer) into .llama-server/ from the bindings' sdist (~8 min)"
	@echo "make bench-path time to first token and tokens/s through each hop"
	@echo "make bench-tracing OpenTelemetry tracing on vs off side by side: TTFT p50, tokens/s (one stream and a batch)"
	@echo "make bench-evallog stream-close latency with logging on vs off; events stored/s vs raw consume"
	@echo "make bench-ratelimit Acquire+Commit decisions/s and latency (memory, Redis) vs a raw grpc.aio echo"
	@echo "make bench-jobs a 2,000-row bulk job: rows/min vs the rate limit, and how the adaptive bound moved"
	@echo "make bench-jobs-interactive interactive p99 time to first token with a bulk job beside it vs without"
	@echo "make bench-adapter continuous batching vs one request at a time, mixed lengths, embeddings batching"
	@echo "make bench-embed-cache the adapter's embedding cache on vs off: texts/s at a Zipf repeat rate, resident memory vs its budget"
	@echo "make setup      create every environment from the lock files (run and test do this)"

$(CURDIR)/.tools/bin/uv:
	$(PYTHON) -m venv .tools
	.tools/bin/pip install --quiet "uv==$(UV_VERSION)"

uv: $(UV)

node_modules/.bin/buf: package.json package-lock.json
	npm ci --silent --no-audit --no-fund
	@touch $@

node: $(BUF)

# Locked installs: a lock file that no longer matches its pyproject fails here.
# The environments whose processes the stack and the tests start many times get their bytecode
# compiled here, their own src/ too: where PYTHONDONTWRITEBYTECODE is set (as on this project's
# development machines) every process would otherwise compile each module it imports at each start
# (triton-local's imports: 2.2-2.6 s of CPU without .pyc files, 1.0-1.3 s with).
COMPILED := $(LIBS) $(SERVICES) $(CLI) tests
setup: uv
	@for project in $(PROJECTS); do \
	  echo "== $$project"; \
	  case " $(COMPILED) " in *" $$project "*) compile=--compile-bytecode;; *) compile=;; esac; \
	  (cd $$project && $(UV) sync --locked --quiet $$compile) || exit 1; \
	  if [ -n "$$compile" ] && [ -d $$project/src ]; then $$project/.venv/bin/python -m compileall -q -j 0 $$project/src > /dev/null || exit 1; fi; \
	done
	@echo "== deploy/triton (exactly its requirements.txt: the Python backend's env in deploy/tests)"
	@$(UV) venv --quiet --allow-existing --python 3.11 deploy/triton/.venv
	@$(UV) pip sync --quiet --python deploy/triton/.venv/bin/python deploy/triton/requirements.txt

# Prometheus and promtool (Debian's package; no daemon started): the e2e suite runs a real Prometheus
# on the stack, make test-deploy checks and unit-tests deploy/prometheus with promtool.
prometheus-tools:
	@tools/install_prometheus.sh

# deploy/triton/requirements.txt from requirements.in (after editing it; needs the registry).
deploy-requirements: uv
	cd deploy/triton && $(UV) pip compile requirements.in --excludes excludes.txt --universal --python-version 3.11 --quiet -o requirements.txt

protos: setup
	tools/gen_protos.sh

# Fails when the committed generated code differs from what the protos generate.
protos-check: setup
	@tmp=$$(mktemp -d) && tools/gen_protos.sh $$tmp && \
	  diff -r -x __pycache__ $$tmp/sluice libs/sluice-protos/src/sluice && rm -rf $$tmp && \
	  echo "generated code is up to date" || { echo "generated code is stale: run 'make protos' and commit"; exit 1; }

proto-lint: node
	$(BUF) lint
	$(BUF) format -d --exit-code

run: setup protos-check
	libs/sluice-stack/.venv/bin/python -m sluice_stack

test-unit: setup
	@for project in $(UNIT_TESTED); do \
	  echo "== unit tests: $$project"; \
	  (cd $$project && .venv/bin/python -m pytest -q) || exit 1; \
	done
	@echo "== unit tests: bench/engine (in triton-local's environment, where its scripts run)"
	@cd bench/engine && ../../services/triton-local/.venv/bin/python -m pytest -q

test-e2e: setup prometheus-tools
	cd tests && .venv/bin/python -m pytest -q --durations=40

# deploy/ without Docker or a cluster: hadolint, kustomize renders validated against Kubernetes
# schemas, the compose file, every config variable set in the manifests, deploy/triton's model
# repository loaded by a real tritonserver, and deploy/prometheus's config and rules checked and
# unit-tested by promtool (deploy/tests, own env).
test-deploy: setup prometheus-tools
	cd deploy/tests && .venv/bin/python -m pytest -q

# The documentation site (docs/, mkdocs.yml) with --strict: a broken link, a missing anchor or a page
# left out of nav fails. README.md lies outside the site: its relative links are checked apart.
# MkDocs comes from docs/'s own lock file (make setup installs it too).
docs: uv
	@cd docs && $(UV) sync --locked --quiet
	docs/.venv/bin/mkdocs build --strict
	docs/.venv/bin/python tools/check_readme_links.py README.md

# The checks that keep the code as it is meant to be (tools/lint's own environment): ruff's rules and
# its formatter's style (ruff.toml), mypy over every project's src (tools/lint/mypy.ini), and the
# import contracts (tools/lint/importlinter.ini: services never import each other, the libraries no
# service, each service's layers in order).
lint: setup
	$(LINT)/.venv/bin/ruff check .
	$(LINT)/.venv/bin/ruff format --check .
	@for project in $(TYPED); do \
		echo "== mypy $$project"; \
		(cd $$project && $(LINT)/.venv/bin/mypy --config-file $(LINT)/mypy.ini --python-executable .venv/bin/python src) || exit 1; \
	done
	PYTHONPATH=$$(ls -d services/*/src libs/sluice-common/src libs/sluice-stack/src $(CLI)/src | paste -sd:) \
		$(LINT)/.venv/bin/lint-imports --no-cache --config $(LINT)/importlinter.ini

test: lint docs proto-lint protos-check test-deploy test-unit test-e2e

bench-engine: setup
	bench/.venv/bin/python bench/bench_engine.py

# No setup on the borrowed GPU machine (no network): there it is the offline kit's one command, each
# call carrying one load (.gpukit/load-K); it stages the loads carried, and the call that completes the
# kit runs the bench, its log in $$OUT/bench-gpu.log where OUT is set (bench/gpu/kit.py device). The
# kit's path is taken where loads were carried or staged and the kit was not built (no .gpukit-build/);
# elsewhere bench-gpu is bench-gpu-networked's path: make setup, then the bench in triton-local's
# environment, which needs llama-cpp-python built with CUDA (CMAKE_ARGS="-DGGML_CUDA=on" make setup),
# else it exits 3, saying so (the same recipe as bench-gpu-networked, after the check). Before setup, `kit.py online` (a 5 s connect to the package index)
# exits 2 where there is no network: a device call that forgot its load says to carry it, rather than
# fail in setup's install of uv after retries with a message about something else.
GPUKIT_HOME := $(or $(SLUICE_GPUKIT_HOME),/tmp/sluice-gpukit)
GPUKIT_CARRIED := $(if $(wildcard .gpukit-build),,$(wildcard .gpukit $(GPUKIT_HOME)/kit.json))
ifneq ($(GPUKIT_CARRIED),)
bench-gpu:
	@echo "bench-gpu: the offline kit's loads ($(GPUKIT_CARRIED)); bench-gpu-networked is the path with a network"
	$(PYTHON) bench/gpu/kit.py device
else
bench-gpu:
	@$(PYTHON) bench/gpu/kit.py online
	@$(MAKE) --no-print-directory setup
	services/triton-local/.venv/bin/python bench/engine/gpu.py
endif

# bench-gpu with a network wherever it runs (make setup first), never the offline kit.
bench-gpu-networked: setup
	services/triton-local/.venv/bin/python bench/engine/gpu.py

# The offline kit for a GPU machine with no network (bench/gpu/kit.py): the CUDA wheel for sm_90 (many
# minutes on 2 cores, once), the engine's wheels and the model in loads of < 64 MiB, then its proof here.
bench-gpu-kit: setup
	bench/.venv/bin/python bench/gpu/kit.py build --prove

bench-colocated: setup
	bench/.venv/bin/python bench/bench_colocated.py

# BENCH_GGML_POOL_LIB=<folder of a libllama.so built with -DGGML_OPENMP=OFF> adds llama.cpp's own thread pool.
bench-threads: setup
	bench/.venv/bin/python bench/bench_threads.py

bench-load: setup
	bench/.venv/bin/python bench/bench_load.py

bench-rolling: setup
	bench/.venv/bin/python bench/bench_rolling.py

# aiperf has its own environment (bench/openai-tool, ~800 MB: transformers, pandas, ...), installed
# from its lock file here rather than by every `make setup`.
bench-openai: setup
	cd bench/openai-tool && $(UV) sync --locked --quiet
	bench/.venv/bin/python bench/bench_openai.py

# llama.cpp's own HTTP server from the llama.cpp source of the locked llama-cpp-python sdist
# (bench/llama_server.py), into .llama-server/<version>/; bench-peer builds it when missing.
llama-server:
	$(PYTHON) bench/llama_server.py build

bench-peer: setup
	bench/.venv/bin/python bench/bench_peer.py

bench-prefix: setup
	bench/.venv/bin/python bench/bench_prefix.py

# The step protocol's round trip: PyTriton (triton-local) vs Triton's Python backend (deploy/triton) vs none.
bench-transport: setup
	bench/.venv/bin/python bench/bench_transport.py

bench-rounds-ahead: setup
	bench/.venv/bin/python bench/bench_rounds_ahead.py

bench-structured: setup
	bench/.venv/bin/python bench/bench_structured.py

bench-path: setup
	bench/.venv/bin/python bench/bench_path.py

bench-tracing: setup
	bench/.venv/bin/python bench/bench_tracing.py

bench-adapter: setup
	bench/.venv/bin/python bench/bench_adapter.py

bench-embed-cache: setup
	bench/.venv/bin/python bench/bench_embed_cache.py

bench-jobs-interactive: setup
	bench/.venv/bin/python bench/bench_jobs_interactive.py

bench-ratelimit: setup
	bench/.venv/bin/python bench/bench_ratelimit.py

bench-jobs: setup
	bench/.venv/bin/python bench/bench_jobs.py

bench-evallog: setup
	bench/.venv/bin/python bench/bench_evallog.py

clean:
	rm -rf .run .tools node_modules build/docs-site
	find . -name .venv -type d -prune -exec rm -rf {} +

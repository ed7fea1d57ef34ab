# `make test` and `make demo` bootstrap .venv with python3.12 on a fresh machine.
# the first python3.12 that actually runs (a pyenv shim can exist without the version behind it)
PYTHON312 := $(shell for p in python3.12 $$HOME/.pyenv/versions/3.12*/bin/python3.12; do \
	"$$p" -c 'import sys; assert sys.version_info[:2] == (3, 12)' >/dev/null 2>&1 && { command -v "$$p"; break; }; done)
VENV := .venv
PY := $(VENV)/bin/python

.PHONY: venv test demo bench clean

$(VENV)/.installed: pyproject.toml
	@if [ -z "$(PYTHON312)" ]; then echo "error: python3.12 not found (install it, e.g. 'pyenv install 3.12'), jaxspec needs Python >= 3.12" >&2; exit 1; fi
	$(PYTHON312) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e ".[test,plot]"
	touch $@

venv: $(VENV)/.installed

test: venv
	$(VENV)/bin/ruff check . && $(VENV)/bin/ruff format --check .
	$(PY) -m pytest -q --durations=15 -n 2 --dist loadfile --no-loadscope-reorder

demo: venv
	$(VENV)/bin/jaxspec generate --block-size 8 --trim-draft --warmup --repeats 5 --compare-none --max-new-tokens 128 --num-slots 1 --max-len 512 \
		--prompt "$$(head -c 300 $$($(PY) -c "import json, os; print(os.path.join(os.path.dirname(json.__file__), 'decoder.py'))"))"

# `make bench` needs jax with CUDA; `make bench PY=python3` runs that Python as it is, without the venv.
bench: $(if $(filter command line,$(origin PY)),,venv)
	$(PY) bench/kernels.py

clean:
	rm -rf $(VENV)

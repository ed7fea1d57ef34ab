# `make test` and `make demo` bootstrap .venv with python3.12 on a fresh machine.
PYTHON312 := $(shell command -v python3.12 2>/dev/null || ls -d $$HOME/.pyenv/versions/3.12*/bin/python3.12 2>/dev/null | tail -n 1)
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
	$(PY) -m pytest -q

demo: venv
	$(VENV)/bin/jaxspec generate --target tests/fixtures/tiny-qwen3_5 --verify-mode none --prompt "def main():" --max-new-tokens 32

bench: venv
	$(PY) bench/kernels.py

clean:
	rm -rf $(VENV)

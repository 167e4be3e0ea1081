# The README's two commands. Each creates .venv on first use and installs the pinned requirements.
#   make demo   # the main job (for now: the tiny model's config, parameter table, JAX-vs-torch forward check)
#   make test   # installs the test extra (pytest, transformers) and runs the suite
PYTHON ?= python3.11
VENV := .venv
PIP := $(VENV)/bin/pip install --quiet --disable-pip-version-check

.PHONY: demo test clean

$(VENV)/.installed: requirements.txt
	$(PYTHON) -m venv $(VENV)
	$(PIP) -r requirements.txt
	touch $@

$(VENV)/.installed-test: $(VENV)/.installed requirements-test.txt
	$(PIP) -r requirements-test.txt
	touch $@

demo: $(VENV)/.installed
	$(VENV)/bin/python model.py configs/tiny.toml --check

test: $(VENV)/.installed-test
	$(VENV)/bin/python -m pytest -q tests

clean:
	rm -rf $(VENV)

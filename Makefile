# Creates .venv with Python 3.12 and installs the project into it.
PY312 := $(shell for p in python3.12 /root/.pyenv/versions/3.12*/bin/python3.12 /usr/local/bin/python3.12 /usr/bin/python3.12; do \
	$$p -c 'import sys; assert sys.version_info[:2] == (3, 12)' >/dev/null 2>&1 && echo $$p && break; done)
VENV := .venv
PYTHON := $(VENV)/bin/python

.PHONY: venv pretrain test test-fast lint gpu-test

venv: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	@test -n "$(PY312)" || (echo "Python 3.12 not found: install python3.12 (jax 0.11.2 needs >= 3.12)"; exit 1)
	$(PY312) -m venv $(VENV)
	$(PYTHON) -m pip install -q --upgrade pip
	$(PYTHON) -m pip install -q -e '.[test,bpe,hf]'
	touch $@

# Main job on the embedded default corpus (tiny model, CPU).
pretrain: venv
	$(PYTHON) -m experiments.pretrain --flagfile=experiments/configs/tiny.flags

lint: venv
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

# CPU suite (what CI runs): lint, then every test not marked gpu (the slow CLI runs too),
# in two worker processes (pytest-xdist): XLA's CPU compiles leave the second core idle.
TEST_WORKERS := -n 2 --dist worksteal

test: lint
	$(PYTHON) -m pytest -m "not gpu" -q $(TEST_WORKERS)

# The CPU suite without the subprocess / CLI runs marked slow.
test-fast: venv
	$(PYTHON) -m pytest -m "not gpu and not slow" -q $(TEST_WORKERS)

# On a GPU machine: the same numeric tests with interpret=False.
gpu-test: venv
	$(PYTHON) -m pytest -m gpu -q

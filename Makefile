# Two commands do everything on a fresh machine: `make demo` and `make test`.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
NOTEBOOKS_OUT := build/tutorials

.PHONY: install demo test lint browser unit unit-default-simd mutants notebooks docs-build docs bench bench-full clean

# A virtual environment with the project (editable) and its pinned dependencies.
# torch 2.13.0 (CPU build) first, so that nothing pulls a CUDA build.
$(STAMP): pyproject.toml requirements.lock
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade "pip>=24"
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -c requirements.lock -e ".[dev]"
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/minipaged demo

# ruff and mypy, every test, the numerical ones again on ATen's portable kernels, the mutant catalogue, every
# notebook (executed), and the documentation site (strict).
test: lint browser unit unit-default-simd mutants notebooks docs-build

# A headless browser for the live page's and the site's tests: Debian's chromium, with a CJK
# font so that the Chinese pages are measured in real glyphs, where this machine can install them.
browser:
	@{ command -v chromium && command -v chromedriver && fc-list :lang=zh | grep -q .; } >/dev/null 2>&1 || \
	  { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null && apt-get update -qq && \
	    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium chromium-driver fonts-noto-cjk >/dev/null; } || \
	  echo "no chromium here: the live page's browser test will be skipped"

lint: $(STAMP)
	$(PY) -m ruff check .
	$(PY) -m mypy

# Every test but the site's, which runs once the site is built (docs-build); a test process per
# core (pytest-xdist), an idle one taking tests from the other's queue (a file's module fixtures
# are then built once in each process that runs its tests).
unit: $(STAMP)
	$(PY) -m pytest -m "not docs" -n auto --dist worksteal --durations=20

# The stages that compare floating-point results, once more on ATen's portable kernels. Other CPUs
# pick other SIMD kernels (AVX-512, AVX2 or none), which sum in other orders and round differently:
# this shows, on this machine, what they compute, and that the tolerances (tests/helpers_tolerances.py,
# bounds for any order) hold for it. Tests whose outcome no rounding can change (rounding_free:
# processes, servers, compiled kernels) run once.
unit-default-simd: $(STAMP)
	ATEN_CPU_CAPABILITY=default $(PY) -m pytest -p no:cacheprovider -q -n auto --dist worksteal \
		-m "(stage0 or stage4 or stage5 or stage7 or stage8 or stage9 or stage10 or stage11 or stage12 or stage13 or stage14 or stage15) and not rounding_free" \
		tests/test_stage*.py

# Every plausible wrong implementation in the catalogue must fail its stage's tests.
mutants: $(STAMP)
	$(VENV)/bin/minipaged mutants

# Notebooks are committed without outputs; they run on a copy, whose outputs the docs show.
notebooks: $(STAMP)
	rm -rf $(NOTEBOOKS_OUT) && mkdir -p $(NOTEBOOKS_OUT)
	cp tutorials/*.ipynb $(NOTEBOOKS_OUT)/
	$(PY) -m pytest -p no:cacheprovider --nbmake --overwrite --nbmake-timeout=600 $(NOTEBOOKS_OUT)

# The site (strict), in English and in Chinese (zh/), with the executed notebooks where
# `make notebooks` ran; then its tests: nothing is loaded from outside the site, pages render
# in a browser kept offline, every page fits the column at 1280 px, the footers follow the
# learner's path, the language switcher and search work in both languages.
docs-build: $(STAMP)
	$(PY) scripts/doc_figures.py
	rm -rf docs/tutorials && mkdir -p docs/tutorials
	if [ -d $(NOTEBOOKS_OUT) ]; then cp $(NOTEBOOKS_OUT)/*.ipynb docs/tutorials/; \
	else cp tutorials/*.ipynb docs/tutorials/; fi
	rm -rf build/site
	NO_MKDOCS_2_WARNING=1 $(PY) -m mkdocs build --strict --site-dir build/site
	MINIPAGED_SITE=build/site $(PY) -m pytest -p no:cacheprovider -m docs tests/test_site.py

docs: $(STAMP)
	$(MAKE) notebooks
	rm -rf docs/tutorials && mkdir -p docs/tutorials && cp $(NOTEBOOKS_OUT)/*.ipynb docs/tutorials/
	$(PY) scripts/doc_figures.py
	NO_MKDOCS_2_WARNING=1 $(PY) -m mkdocs serve

# CTranslate2, throughput.py's fourth side (pyproject's `bench` extra); without it that side is skipped, and says why.
# nano-vllm-fork (the package index's nano-vllm), host_path.py's other side, without its dependencies (CUDA's).
NANO_VLLM = $(PY) -m pip install --quiet --no-deps nano-vllm-fork xxhash || echo "no nano-vllm: host_path.py runs alone"
bench: $(STAMP)
	$(PY) -m pip install --quiet -c requirements.lock -e ".[bench]" || echo "no CTranslate2: throughput.py runs without it"
	$(NANO_VLLM)
	@for script in bench/*.py; do \
		case $$script in */workloads.py|*/peer_models.py) continue;; esac; \
		echo "== $$script"; $(PY) $$script --quick || exit 1; \
	done
	$(PY) -m pytest bench/micro -p no:cacheprovider -o python_files="bench_*.py" --benchmark-only \
		--benchmark-columns=min,median,mean,ops --benchmark-sort=name

# The full runs, whose plots the documentation shows.
bench-full: $(STAMP)
	$(PY) -m pip install --quiet -c requirements.lock -e ".[bench]" || echo "no CTranslate2: throughput.py runs without it"
	$(NANO_VLLM)
	@for script in bench/*.py; do \
		case $$script in */workloads.py|*/peer_models.py) continue;; esac; \
		echo "== $$script"; $(PY) $$script || exit 1; \
	done
	mkdir -p docs/benchmarks && cp bench/results/*.png docs/benchmarks/

clean:
	rm -rf build docs/tutorials .cache/mkdocs-jupyter .pytest_cache .ruff_cache .benchmarks

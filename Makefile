# The two commands of the README: `make demo` and `make test`. Each sets up everything it needs.
PY      := .venv/bin/python
STAMP   := .venv/.installed
SYSSTAMP := .qtp/.system-deps

.PHONY: demo test bench dist deps venv db-start db-stop clean

venv: $(STAMP)

$(STAMP): setup.cfg pyproject.toml requirements.lock
	test -x $(PY) || python3 -m venv .venv
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip uninstall -q -y qtp 2>/dev/null  # the distribution's name before qtp-queued
	$(PY) -m pip install -q -c requirements.lock -e '.[test,spark,embedded]'
	touch $(STAMP)

# System packages: MariaDB server binaries (10.5+) where missing, and the JDBC drivers for Spark.
deps: $(SYSSTAMP)

$(SYSSTAMP): scripts/system-deps.sh
	bash scripts/system-deps.sh
	mkdir -p .qtp && touch $(SYSSTAMP)

db-start: venv deps
	$(PY) -m qtp db start

db-stop: venv
	$(PY) -m qtp db stop

demo: venv deps
	$(PY) -m qtp db start
	$(PY) -m qtp.demo

# Three workers (pytest-xdist) on two cores: much of the suite waits on processes and databases. Measured on
# this 2-core machine: worksteal in file order 9 min 11 s; loadgroup with the slow tests first 10 min 53 s
# (the heavy tests all at once). TEST_WORKERS=0: one process.
TEST_WORKERS ?= 3
test: venv deps
	$(PY) -m pytest -p no:cacheprovider -n $(TEST_WORKERS) --dist worksteal tests

bench: venv deps
	$(PY) benchmarks/tm_overhead.py

# The wheel and sdist in dist/, built by the standard front end (tests/test_packaging_dist.py tests them).
dist: venv
	$(PY) -m build --outdir dist .

clean:
	-$(PY) -m qtp db stop
	rm -rf .qtp .venv recovery_logs/*/

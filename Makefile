# Set-up and the two commands of the README: `make run` (the main job) and `make test` (the test suite).
# Both install into .venv first; the install is skipped while the stamp is newer than its inputs.

VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
EXTRAS := test,examples,bench

.PHONY: install run test clean

install: $(STAMP)

$(STAMP): pyproject.toml constraints.txt
	@test -x $(PY) || python3.11 -m venv $(VENV) || python3 -m venv $(VENV)
	$(PY) -m pip install --quiet -c constraints.txt -e '.[$(EXTRAS)]'
	@touch $@

# The main job: the default comparison of `gcomp bench`.
run: install
	$(VENV)/bin/gcomp bench

# pytest exits 5 when it collects no test: make fails then, as it should.
test: install
	$(PY) -m pytest -q

clean:
	rm -rf $(VENV)

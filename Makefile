# Set-up and the two commands of the README: `make run` (the main job) and `make test` (the test suite).
# Both install into .venv first; the install is skipped while the stamp is newer than its inputs.

VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
EXTRAS := test,examples,bench,lightning,accelerate,transformers

.PHONY: install run test clean

install: $(STAMP)

$(STAMP): pyproject.toml constraints.txt
	@test -x $(PY) || python3.11 -m venv $(VENV) || python3 -m venv $(VENV)
	$(PY) -m pip install --quiet -c constraints.txt -e '.[$(EXTRAS)]'
	@# gcomp bench shapes links with ip and tc (iproute2): installed here where missing and possible
	@command -v tc >/dev/null && command -v ip >/dev/null || \
	  { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null && apt-get install -y -qq iproute2 >/dev/null; } || \
	  echo "note: iproute2 (ip, tc) is missing and could not be installed: gcomp bench will run unshaped"
	@touch $@

# The main job: the default comparison of `gcomp bench`.
run: install
	$(VENV)/bin/gcomp bench

# pytest exits 5 when it collects no test: make fails then, as it should.
test: install
	$(PY) -m pytest -q

clean:
	rm -rf $(VENV)

"""docs/add-a-method.md's example runs as written and keeps every contract, under DDP and FSDP2: the block marked
``<!-- test: the example -->`` is written to a module, imported, and checked with ``gcomp.testing.check_method``.
It stays within 20 lines of code."""
from __future__ import annotations

import importlib
import re
from pathlib import Path

import pytest

from gcomp import registry
from gcomp.testing import check_method

DOC = Path(__file__).resolve().parents[1] / "docs" / "add-a-method.md"
BLOCK = re.compile(r"^<!-- test: the example -->\n```python\n(?P<code>.*?)^```$", re.M | re.S)


def example() -> str:
    found = BLOCK.findall(DOC.read_text())
    assert len(found) == 1, "docs/add-a-method.md must hold one block marked <!-- test: the example -->"
    return found[0]


def test_the_example_is_at_most_20_lines_of_code():
    lines = [line for line in example().splitlines() if line.strip()]
    assert len(lines) <= 20, lines


@pytest.fixture
def module(tmp_path, monkeypatch):
    """The example as the module ``add_a_method_example`` on ``sys.path`` (the rank processes import it)."""
    (tmp_path / "add_a_method_example.py").write_text(example())
    monkeypatch.syspath_prepend(str(tmp_path))
    before = set(registry._REGISTRY)
    try:
        yield importlib.import_module("add_a_method_example")
    finally:
        for name in set(registry._REGISTRY) - before:
            del registry._REGISTRY[name]


@pytest.mark.slow
def test_the_example_keeps_every_contract_under_ddp_and_fsdp2(module):
    report = check_method(module.scaled_sign, world_sizes=(2, 3))
    passed = {r.contract for r in report.passed}
    assert {"reduce", "conservation", "fidelity", "bytes", "fsdp", "state_dict"} <= passed, report
    assert {r.config for r in report.passed if r.contract == "fsdp"} >= {"ws2 fidelity", "ws3 conservation"}

"""``gcomp bench`` with ``auto``: its runs prune the model when the methods it may choose include a pruning one."""
from __future__ import annotations

import pytest

from gcomp.bench.methods import parse_method


@pytest.mark.parametrize("spec, prunes", [
    ("auto", True),                                   # "exact": identity, and pactrain on a pruned model
    ("auto:allow=half", True),
    ("auto:allow=identity|fp16|topk:ratio=0.01", False),
    ("auto:allow=identity|pactrain:ternary=true", True),
])
def test_auto_runs_prune_when_their_allowed_methods_do(spec, prunes):
    assert parse_method(spec).prunes is prunes

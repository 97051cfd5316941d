"""What ``auto`` may choose from: the presets, a user's list, and clear errors for a bad one."""
from __future__ import annotations

import pytest

import gcomp
from gcomp.auto import allowed_methods
from gcomp.registry import UnknownMethodError, parse_spec


@pytest.mark.parametrize("pruned", [False, True])
def test_exact_holds_only_lossless_methods(pruned):
    allowed = allowed_methods("exact", pruned)
    assert allowed == (["identity", "pactrain"] if pruned else ["identity"])
    for spec in allowed:
        name, params = parse_spec(spec)
        assert gcomp.create(name, **params).lossless, spec


def test_half_adds_the_half_precision_casts():
    assert allowed_methods("half", False) == ["identity", "fp16", "bf16"]


def test_a_list_is_taken_as_given_and_checked():
    specs = ["identity", "pactrain:ternary=true", "topk:ratio=0.01", "powersgd:rank=2"]
    assert allowed_methods(specs, True) == specs


@pytest.mark.parametrize("allow, error, match", [
    ("exactly", ValueError, "one of 'exact', 'half'"),
    ([], ValueError, "lists no method"),
    (["fp16", "fp16"], ValueError, "twice"),
    (["auto"], ValueError, "cannot list auto"),
    (["topkk"], UnknownMethodError, "topk"),                 # the closest name is offered
    (["topk:ratio=abc"], ValueError, "must be a float"),
    (["topk:ratio=7"], ValueError, "allow entry 'topk:ratio=7'"),
    (["spardl"], ValueError, "point-to-point"),
    (["hierarchical"], ValueError, "cannot price"),
])
def test_a_bad_allow_fails_with_the_usual_messages(allow, error, match):
    with pytest.raises(error, match=match):
        allowed_methods(allow, False)


def test_spaces_around_a_preset_are_dropped_as_around_a_list_s_entries_but_case_is_kept():
    assert gcomp.create("auto", allow=" exact ").params["allow"] == "exact"
    assert gcomp.create("auto", allow="half ").specs == ["identity", "pactrain", "fp16", "bf16"]
    with pytest.raises(ValueError, match="did you mean the preset 'exact'. Names are case-sensitive"):
        gcomp.create("auto", allow="Exact")
    with pytest.raises(ValueError, match="one of 'exact', 'half' .*; did you mean the preset 'half'"):
        allowed_methods("hlaf", False)

"""``gcomp.testing.check_method`` on methods from outside the package: two methods of tests/plugin_methods.py
registered by entry point (a ``*.dist-info`` directory on ``sys.path``, as an installed package would have),
one that keeps every contract and one whose decode drops an entry; a module-level factory; the registered methods
broken in their error model (tests/broken_methods.py), which only the fidelity contract sees; what is refused.

The factory test runs first on purpose: it starts the 1-rank pool before the plugin's directory is on
``sys.path``, so the entry-point test also covers a worker that has to find the plugin late.
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

import gcomp
import gcomp.testing
from gcomp import registry
from gcomp.testing import ContractError, check_method
from tests import broken_methods, plugin_methods

GOOD, BROKEN = "kit-reversed", "kit-dropping"


@pytest.fixture
def plugin(tmp_path, monkeypatch):
    """The two methods registered through a ``gcomp.methods`` entry point; unregistered afterwards."""
    info = tmp_path / "gcomp_kit_plugin-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: gcomp-kit-plugin\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(f"[{registry.ENTRY_POINT_GROUP}]\n"
                                           f"{GOOD} = tests.plugin_methods:reversed_method\n"
                                           f"{BROKEN} = tests.plugin_methods:dropping_method\n")
    monkeypatch.syspath_prepend(str(tmp_path))  # spawned rank processes start with this sys.path
    before = set(registry._REGISTRY)
    registry.load_entry_points(force=True)
    try:
        yield
    finally:
        for name in set(registry._REGISTRY) - before:
            del registry._REGISTRY[name]


def test_a_module_level_factory_passes():
    report = check_method(plugin_methods.reversed_method, world_sizes=(1,))
    assert report.ok and report.method == "tests.plugin_methods:reversed_method"
    skipped = {r.contract: r.detail for r in report.skipped}
    assert set(skipped) == {"conservation", "configuration", "fidelity", "bytes", "fsdp"}, report
    assert "error_feedback" in skipped["conservation"] and "registered name" in skipped["configuration"]
    assert {r.contract for r in report.passed} >= {"fidelity", "fsdp"}  # exact; its draws and conservation skip


def test_an_entry_point_method_that_keeps_the_contracts_passes(plugin):
    assert {GOOD, BROKEN} <= set(gcomp.available())
    report = check_method(GOOD, world_sizes=(1, 2, 3))
    checked = {r.contract for r in report.passed}
    assert checked == {key for key, _ in gcomp.testing.CONTRACTS.values()} - {"conservation", "bytes"}, report
    assert {r.config.split()[0] for r in report.results if r.contract == "reduce"} == {"ws1", "ws2", "ws3"}


def test_an_entry_point_method_that_drops_an_entry_fails_the_lossless_contract(plugin):
    with pytest.raises(ContractError) as err:
        check_method(BROKEN, world_sizes=(1, 2, 3))
    assert isinstance(err.value, AssertionError)
    assert err.value.report.failed_contracts() == ["lossless", "fidelity", "fsdp"], err.value.report
    assert "4 lossless" in str(err.value) and "9 fidelity" in str(err.value) and BROKEN in str(err.value)
    # per world: 2 fake-bucket layouts and 4 DDP configurations (4); 2 layouts (9); the shard and AVG (11)
    assert len(err.value.report.failures) == 3 * (2 + 4 + 2 + 2)
    report = check_method(BROKEN, world_sizes=(1,), contracts=["reduce"])
    assert report.ok, report  # the reduce contract cannot see it: the mean of what each rank decodes


@pytest.mark.parametrize("factory", [broken_methods.fp16_zeroing_first, broken_methods.topk_smallest,
                                     broken_methods.qsgd_doubled], ids=lambda f: f.__name__)
def test_a_method_broken_in_its_error_model_fails_the_fidelity_contract(factory):
    """Consistent (every rank decodes alike what was sent: contract 1 passes) but not what it promises."""
    report = check_method(factory, world_sizes=(1, 2), contracts=["reduce", "fidelity", "fsdp"],
                          raise_on_failure=False)
    assert "fidelity" in report.failed_contracts() and "reduce" not in report.failed_contracts(), report
    with pytest.raises(ContractError, match="9 fidelity"):
        raise ContractError(report)
    kind = factory().compressor.traits.fidelity.kind
    assert all(f"fidelity {kind}" in r.detail for r in report.failures if r.contract == "fidelity"), report


def test_the_plugin_is_gone_afterwards():
    assert GOOD not in gcomp.available() and BROKEN not in gcomp.available()


def test_a_lambda_is_refused_clearly():
    with pytest.raises(TypeError, match="lambda.*top level of an importable module"):
        check_method(lambda: plugin_methods.reversed_method())

    def nested():
        return plugin_methods.reversed_method()

    with pytest.raises(TypeError, match="defined inside a function"):
        check_method(nested)


def test_an_unknown_name_is_refused():
    with pytest.raises(gcomp.UnknownMethodError, match="identity"):
        check_method("identiti")


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="1 to 8"):
        check_method("identity", world_sizes=(0,))
    with pytest.raises(ValueError, match="unknown contract"):
        check_method("identity", contracts=["speed"])


def test_the_kit_imports_neither_pytest_nor_hypothesis():
    """They are test extras: gcomp.testing must import without them (a lazy import inside a function is fine)."""
    for path in Path(gcomp.testing.__file__).parent.glob("*.py"):
        for node in ast.parse(path.read_text()).body:
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else (
                [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            assert not [n for n in names if n.split(".")[0] in ("pytest", "hypothesis")], f"{path.name}: {names}"

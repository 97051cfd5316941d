"""Selection by name: available, describe, create (parameter validation), register and entry points."""
from __future__ import annotations

import math
import re
import sys
import textwrap
import uuid
from typing import Annotated

import pytest

import gcomp
import gcomp.registry
from gcomp.collectives import AllreduceCommunicator
from gcomp.compressors.cast import CastCompressor

BUILTINS = ("bf16", "fp16", "identity", "topk")


@pytest.fixture
def scratch_registry():
    """Whatever a test registers is gone afterwards: the registry is restored to its state before the test."""
    saved = dict(gcomp.registry._REGISTRY)
    yield gcomp.registry._REGISTRY
    gcomp.registry._REGISTRY.clear()
    gcomp.registry._REGISTRY.update(saved)


def _hint(message: str) -> list[str]:
    """The names in the 'did you mean ...?' part of an unknown-method message."""
    m = re.search(r"did you mean (.*?)\?", message)
    assert m, f"no 'did you mean' hint in: {message}"
    return re.findall(r"'([^']*)'", m.group(1))


# --- available / describe -----------------------------------------------------------------------------------


def test_available_is_sorted_and_holds_the_builtins():
    names = gcomp.available()
    assert names == sorted(names)
    assert len(names) == len(set(names))
    for name in BUILTINS:
        assert name in names


@pytest.mark.parametrize("name", gcomp.available())
def test_describe_mentions_collective_parameters_defaults_and_ranges(name):
    text = gcomp.describe(name)
    method = gcomp.create(name)
    assert name in text
    assert (method.collective or "chosen per bucket") in text
    spec = gcomp.spec(name)
    for p in spec.params.values():
        assert p.name in text
        assert repr(p.default) in text
        if p.allowed is not None:
            assert str(p.allowed) in text


def test_describe_topk_in_words():
    text = gcomp.describe("topk")
    assert "allgather" in text
    assert "ratio" in text and "0.01" in text and "(0, 1]" in text


# --- create: parameter validation ---------------------------------------------------------------------------


@pytest.mark.parametrize("value", [0, 0.0, 1.5, math.nan, -1, "0.1", True, math.inf])
def test_topk_rejects_bad_ratio_naming_parameter_range_and_value(value):
    with pytest.raises(ValueError) as excinfo:
        gcomp.create("topk", ratio=value)
    message = str(excinfo.value)
    assert "'ratio'" in message
    assert "(0, 1]" in message
    shown = {repr(value), str(value)}
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        shown |= {repr(float(value)), str(float(value))}
    rest = message.replace("(0, 1]", "")
    assert any(s in rest for s in shown), f"value {value!r} not shown in: {message}"


def test_huge_int_ratio_is_a_value_error():
    with pytest.raises(ValueError, match="'ratio'"):
        gcomp.create("topk", ratio=10**400)


def test_topk_int_ratio_is_accepted_and_converted_to_float():
    method = gcomp.create("topk", ratio=1)
    assert method.params == {"ratio": 1.0, "positions": "coded", "values": "fp32"}
    assert type(method.params["ratio"]) is float
    assert type(method.compressor.ratio) is float and method.compressor.ratio == 1.0


def test_default_parameters_are_recorded():
    method = gcomp.create("topk")
    assert method.name == "topk"
    assert method.params == {name: p.default for name, p in gcomp.spec("topk").params.items()}
    assert method.params["ratio"] == 0.01


def test_unknown_parameter_lists_the_accepted_ones():
    with pytest.raises(ValueError) as excinfo:
        gcomp.create("topk", ratoi=0.1)
    message = str(excinfo.value)
    assert "ratoi" in message
    assert "accepted" in message and "ratio" in message.split("accepted", 1)[1]


def test_parameterless_method_rejects_any_parameter():
    with pytest.raises(ValueError, match="accepted: none"):
        gcomp.create("identity", ratio=0.5)


# --- unknown names ------------------------------------------------------------------------------------------


def test_unknown_method_error_is_a_value_error():
    assert issubclass(gcomp.UnknownMethodError, ValueError)


@pytest.mark.parametrize("typo, expected", [("topkk", "topk"), ("fp61", "fp16"), ("idenity", "identity"),
                                            ("bf61", "bf16")])
@pytest.mark.parametrize("entry", [gcomp.create, gcomp.describe, gcomp.spec])
def test_unknown_name_lists_the_closest_names(entry, typo, expected):
    with pytest.raises(gcomp.UnknownMethodError) as excinfo:
        entry(typo)
    assert expected in _hint(str(excinfo.value))
    assert typo in str(excinfo.value)


def test_far_unknown_name_still_raises_and_lists_registered():
    with pytest.raises(gcomp.UnknownMethodError) as excinfo:
        gcomp.create("zzzzzzzzzzzz")
    for name in BUILTINS:
        assert name in str(excinfo.value)


# --- register -----------------------------------------------------------------------------------------------


def _register_scaled(name: str, calls: list):
    @gcomp.register(name, paper="A test, 2024")
    def scaled(gain: Annotated[float, gcomp.Range(0, 10, low_open=True), "a made-up gain"] = 2.0,
               mode: Annotated[str, gcomp.OneOf("fast", "slow"), "how to go"] = "fast",
               rounds: Annotated[int, gcomp.Range(1, None)] = 3) -> gcomp.Method:
        """A custom test method.

        Second paragraph, not in the summary.
        """
        calls.append((gain, mode, rounds))
        return gcomp.Method(CastCompressor(), gcomp.NoMemory(), AllreduceCommunicator())

    return scaled


def test_registered_method_is_available_creatable_describable(scratch_registry):
    calls = []
    factory = _register_scaled("test-scaled", calls)
    assert "test-scaled" in gcomp.available()
    assert gcomp.available() == sorted(gcomp.available())

    method = gcomp.create("test-scaled", gain=4, mode="slow")
    assert isinstance(method, gcomp.Method)
    assert method.name == "test-scaled"
    assert method.params == {"gain": 4.0, "mode": "slow", "rounds": 3}
    assert calls == [(4.0, "slow", 3)]
    assert gcomp.spec("test-scaled").factory is factory
    assert gcomp.spec("test-scaled").summary == "A custom test method."

    text = gcomp.describe("test-scaled")
    assert "A custom test method." in text and "Second paragraph" not in text
    assert "allreduce" in text and "A test, 2024" in text
    for fragment in ("gain", "2.0", "(0, 10]", "a made-up gain", "mode", "'fast'", "one of 'fast', 'slow'",
                     "rounds", "3", "[1, inf)"):
        assert fragment in text, fragment


@pytest.mark.parametrize("params, fragment", [({"gain": 0}, "'gain'"), ({"gain": 11.0}, "(0, 10]"),
                                              ({"mode": "medium"}, "one of 'fast', 'slow'"),
                                              ({"rounds": 0}, "'rounds'"), ({"rounds": 2.5}, "an int"),
                                              ({"rounds": True}, "an int")])
def test_registered_method_validates_before_calling_the_factory(scratch_registry, params, fragment):
    calls = []
    _register_scaled("test-scaled", calls)
    with pytest.raises(ValueError) as excinfo:
        gcomp.create("test-scaled", **params)
    assert fragment in str(excinfo.value)
    assert "test-scaled" in str(excinfo.value)
    assert calls == []


def test_duplicate_name_raises_unless_override(scratch_registry):
    first = _register_scaled("test-dup", [])

    def other() -> gcomp.Method:
        """Another one."""
        return gcomp.Method(CastCompressor(), gcomp.NoMemory(), AllreduceCommunicator())

    with pytest.raises(ValueError, match="already registered"):
        gcomp.register("test-dup")(other)
    assert gcomp.spec("test-dup").factory is first

    gcomp.register("test-dup", override=True)(other)
    assert gcomp.spec("test-dup").factory is other
    assert gcomp.create("test-dup").params == {}
    assert gcomp.available().count("test-dup") == 1


def test_builtin_name_cannot_be_taken_silently(scratch_registry):
    topk = gcomp.spec("topk")

    def fake() -> gcomp.Method:
        return gcomp.Method(CastCompressor(), gcomp.NoMemory(), AllreduceCommunicator())

    with pytest.raises(ValueError, match="topk"):
        gcomp.register("topk")(fake)
    assert gcomp.spec("topk") is topk


def test_factory_parameter_without_default_raises_type_error(scratch_registry):
    def nodefault(ratio: float) -> gcomp.Method:
        return gcomp.Method(CastCompressor(), gcomp.NoMemory(), AllreduceCommunicator())

    with pytest.raises(TypeError, match="ratio"):
        gcomp.register("test-nodefault")(nodefault)
    assert "test-nodefault" not in gcomp.available()


@pytest.mark.parametrize("bad", ["", None, 3])
def test_bad_method_name_is_refused(bad):
    with pytest.raises(ValueError):
        gcomp.register(bad)


# --- entry points -------------------------------------------------------------------------------------------


def _fake_distribution(root, entry_points: dict[str, str], modules: dict[str, str]) -> None:
    """A minimal installed distribution: a dist-info folder with METADATA and entry_points.txt, plus modules."""
    info = root / "fakeplugin-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: fakeplugin\nVersion: 0.1\n")
    lines = ["[gcomp.methods]"] + [f"{name} = {target}" for name, target in entry_points.items()]
    (info / "entry_points.txt").write_text("\n".join(lines) + "\n")
    for module, source in modules.items():
        (root / f"{module}.py").write_text(textwrap.dedent(source))


@pytest.fixture
def plugin_env(tmp_path, monkeypatch, scratch_registry):
    """Yields a function that installs a fake plugin distribution; undoes sys.path, sys.modules and registry."""
    created: list[str] = []

    def install(entry_points, modules):
        _fake_distribution(tmp_path, entry_points, modules)
        created.extend(modules)
        monkeypatch.syspath_prepend(str(tmp_path))

    yield install
    for module in created:
        sys.modules.pop(module, None)


def _unique(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex[:8]}"


FACTORY_MODULE = '''
from typing import Annotated

import gcomp
from gcomp.collectives import AllreduceCommunicator
from gcomp.compressors.cast import CastCompressor


def make(scale: Annotated[float, gcomp.Range(0, 1)] = 0.5) -> gcomp.Method:
    """A plugin method declared by an entry point that names its factory."""
    return gcomp.Method(CastCompressor(), gcomp.NoMemory(), AllreduceCommunicator())
'''

SELF_REGISTERING_MODULE = '''
import gcomp
from gcomp.collectives import AllreduceCommunicator
from gcomp.compressors.cast import CastCompressor


@gcomp.register("{name}")
def selfreg() -> gcomp.Method:
    """A plugin method that registers itself when its module is imported."""
    return gcomp.Method(CastCompressor(), gcomp.NoMemory(), AllreduceCommunicator())
'''


def test_entry_point_naming_a_factory_is_registered_under_its_name(plugin_env):
    module, ep_name = _unique("fake_gcomp_plugin"), _unique("plugin-factory")
    plugin_env({ep_name: f"{module}:make"}, {module: FACTORY_MODULE})
    assert ep_name not in gcomp.registry._REGISTRY

    gcomp.registry.load_entry_points(force=True)
    assert ep_name in gcomp.available()
    method = gcomp.create(ep_name, scale=1)
    assert method.name == ep_name and method.params == {"scale": 1.0}
    assert gcomp.spec(ep_name).factory is sys.modules[module].make
    assert "names its factory" in gcomp.describe(ep_name)
    with pytest.raises(ValueError, match="'scale'"):
        gcomp.create(ep_name, scale=2.0)


def test_entry_point_naming_a_self_registering_module(plugin_env):
    module, ep_name, name = _unique("fake_gcomp_plugin_mod"), _unique("plugin-module"), _unique("plugin-self")
    plugin_env({ep_name: module}, {module: SELF_REGISTERING_MODULE.replace("{name}", name)})

    gcomp.registry.load_entry_points(force=True)
    assert name in gcomp.available()
    assert ep_name not in gcomp.available()  # a module is imported, not registered itself
    assert gcomp.create(name).name == name
    assert "registers itself" in gcomp.describe(name)


def test_both_kinds_of_entry_point_in_one_distribution(plugin_env):
    factory_mod, self_mod = _unique("fake_gcomp_plugin"), _unique("fake_gcomp_plugin_mod")
    ep_factory, ep_module, name = _unique("plugin-factory"), _unique("plugin-module"), _unique("plugin-self")
    plugin_env({ep_factory: f"{factory_mod}:make", ep_module: self_mod},
               {factory_mod: FACTORY_MODULE, self_mod: SELF_REGISTERING_MODULE.replace("{name}", name)})
    gcomp.registry.load_entry_points(force=True)
    names = gcomp.available()
    assert ep_factory in names and name in names
    for builtin in BUILTINS:
        assert builtin in names


def test_a_broken_plugin_warns_and_does_not_hide_the_others(plugin_env):
    module, ep_good = _unique("fake_gcomp_plugin"), _unique("plugin-factory")
    plugin_env({_unique("plugin-broken"): "no_such_module_for_gcomp_tests:make", ep_good: f"{module}:make"},
               {module: FACTORY_MODULE})
    with pytest.warns(Warning, match="no_such_module_for_gcomp_tests"):
        gcomp.registry.load_entry_points(force=True)
    assert ep_good in gcomp.available()


def test_registry_is_clean_after_plugin_tests():
    assert not [n for n in gcomp.available() if n.startswith(("plugin-", "test-"))]


def test_spec_argument_is_a_usage_error_that_keeps_its_message():
    import argparse

    from gcomp.registry import spec_argument

    parser = argparse.ArgumentParser()
    parser.add_argument("--method", type=spec_argument)
    assert parser.parse_args(["--method", "topk:ratio=0.05"]).method == ("topk", {"ratio": 0.05})
    with pytest.raises(argparse.ArgumentTypeError, match="parameter of topk"):
        spec_argument("topk:rat=1")

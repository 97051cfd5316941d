"""A decode runs on the backend's threads, beside the next bucket's encode (and, in the contract suite, a deepcopy
of the method): it adds no entry to a dict or an attribute of the method itself, which another thread may be
iterating over (a codec is a pure pair: its state goes in and out of ``encode`` explicitly)."""
from __future__ import annotations

import torch

import gcomp
from gcomp.bench import codec_table


def _sizes(obj, seen: set, path: str = "method") -> dict[str, int]:
    """The size of every dict and attribute table reachable from ``obj`` (caches and tensors left out)."""
    if id(obj) in seen or isinstance(obj, (torch.Tensor, torch.Generator, str, int, float, bool, type(None),
                                           torch.nn.Module)):
        return {}
    seen.add(id(obj))
    out: dict[str, int] = {}
    if isinstance(obj, dict):
        out[path] = len(obj)
        items = list(obj.items())
    elif isinstance(obj, (list, tuple)):
        items = list(enumerate(obj))
    elif hasattr(obj, "__dict__"):
        out[path + ".__dict__"] = len(vars(obj))
        items = list(vars(obj).items())
    else:
        return out
    for key, value in items:
        out.update(_sizes(value, seen, f"{path}.{key}"))
    return out


def _codecs(method) -> list:
    """The compressors a method decodes with: its own, or its parts' (a composite: ``auto``, ``hierarchical``)."""
    if isinstance(method, gcomp.Method):
        return [method.compressor]
    return [codec for part in method.parts for codec in _codecs(part)]


def test_no_registered_method_grows_itself_while_decoding(monkeypatch):
    grew: dict[str, set] = {}
    create = gcomp.create

    def watched(name, **params):
        method = create(name, **params)
        for compressor in _codecs(method):
            _watch(method, compressor, name)
        return method

    def _watch(method, compressor, name):
        decode = compressor.decode

        def wrapped(*args, _decode=decode, _name=name, **kwargs):
            before = _sizes(method, set())
            result = _decode(*args, **kwargs)
            after = _sizes(method, set())
            # a table that was there and changed size (a new key, a new attribute); a value replaced by a new object
            # (a step's flags) adds no entry where another thread iterates
            changed = {p for p in before.keys() & after.keys() if before[p] != after[p]}
            if changed:
                grew.setdefault(_name, set()).update(changed)
            return result

        compressor.decode = wrapped

    monkeypatch.setattr(codec_table.gcomp, "create", watched)
    gcomp_rows = [r for r in codec_table.default_rows() if not r.startswith("torch:")]  # PyTorch's hook: not ours
    rows = codec_table.run(sizes_mb=(0.25,), methods=gcomp_rows, repeats=1, log=lambda *_: None)
    assert len(rows) == len(gcomp_rows)  # every method, and pactrain ternary
    assert grew == {}

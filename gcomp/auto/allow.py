"""The methods ``auto`` may choose from: ``allow="exact"``, ``"half"``, or the user's own list of specs."""
from __future__ import annotations

import difflib
from typing import Sequence

from gcomp.core import ALLGATHER, ALLREDUCE, Compressor
from gcomp.method import Method
from gcomp.registry import UnknownMethodError, available, create, parse_spec

EXACT = ("identity",)  # pactrain joins them on a pruned model: its packed sum is the dense one's, losslessly
HALF = ("fp16", "bf16")
PRESETS = ("exact", "half")
# the collectives whose cost the choice can price from a bucket's counted calls and bytes alone
PRICED = (ALLREDUCE, ALLGATHER)


def allowed_methods(allow: str | Sequence[str], pruned: bool, given: object = None) -> list[str]:
    """The specs ``auto`` chooses among, in the order ties are broken: ``"exact"`` (``identity``, and
    ``pactrain`` when ``pruned``: both equal a dense all-reduce up to summation order), ``"half"`` (those and
    ``fp16``, ``bf16``), or ``allow`` itself, a list of method specs (each stripped of surrounding spaces),
    each checked here as ``gcomp.create`` checks it (an unknown name names the closest presets and methods).
    Raises ``ValueError`` for anything else: a preset misspelt or inside a list, an empty entry or list, a
    spec twice, ``auto`` itself, a method whose collective the choice cannot price (point-to-point schedules,
    hierarchical ones), or one whose codec holds back gradient it cannot hand over at a switch
    (``Compressor.flush``). ``given``: ``allow`` as the user wrote it (a string joined by ``|``), for messages."""
    if isinstance(allow, str):
        if allow not in PRESETS:
            raise ValueError(f"auto: allow must be one of {', '.join(map(repr, PRESETS))} or a list of method "
                             f"specs; got {allow!r}{_closest(allow)}")
        exact = list(EXACT) + (["pactrain"] if pruned else [])
        return exact if allow == "exact" else exact + list(HALF)
    given = list(allow) if given is None else given
    specs = [str(s).strip() for s in allow]
    if not specs:
        raise ValueError("auto: allow lists no method")
    for i, text in enumerate(specs, 1):
        _check_entry(i, text, given)
    if len(set(specs)) != len(specs):
        raise ValueError(f"auto: allow lists a method twice: {specs}")
    for text in specs:
        try:
            name, params = parse_spec(text)
            method = create(name, **params)
        except ValueError as err:
            raise ValueError(f"auto: allow entry {text!r}: {err}") from None
        if method.collective not in PRICED:
            raise ValueError(f"auto: allow entry {text!r} runs the {method.collective!r} collective, "
                             f"which auto cannot price yet; it chooses among {' and '.join(PRICED)} methods")
        codec = method.compressor if isinstance(method, Method) else None
        if codec is not None and codec.holds_gradient and type(codec).flush is Compressor.flush:
            raise ValueError(f"auto: allow entry {text!r} keeps gradient it did not send inside its codec and cannot "
                             "hand it to another method at a switch; leave its error feedback off")
    return specs


def _check_entry(number: int, text: str, given: object) -> None:
    """A ValueError for an entry of a list that is empty, a preset, ``auto`` or no registered method's name."""
    if not text:
        raise ValueError(f"auto: allow entry {number} of {given!r} is empty; list method specs, in a string "
                         f"joined by '|' (identity|fp16)")
    name = text.partition(":")[0].strip()
    if name == "auto":
        raise ValueError("auto: allow cannot list auto itself")
    if name in PRESETS:
        held = ", ".join(EXACT + (HALF if name == "half" else ()))
        raise ValueError(f"auto: allow entry {text!r} is a preset, which stands alone (allow={name!r}); a list "
                         f"names methods only ({name!r} is {held}, with pactrain on a pruned model)")
    if name not in available():
        raise UnknownMethodError(f"auto: allow entry {text!r} is neither a preset ({', '.join(PRESETS)}) nor a "
                                 f"registered method ({', '.join(_methods())}){_closest(name)}")


def _methods() -> list[str]:
    return [n for n in available() if n != "auto"]


def _closest(name: str) -> str:
    """"; did you mean ...?" with the presets and methods closest to ``name`` (one differing in case first)."""
    presets = {p: f"the preset {p!r}" for p in PRESETS}
    candidates = {**presets, **{m: repr(m) for m in _methods()}}
    same = [c for c in candidates if c.lower() == name.strip().lower()]
    if same:
        return f"; did you mean {candidates[same[0]]}? Names are case-sensitive"
    close = difflib.get_close_matches(name.strip(), candidates, n=3, cutoff=0.4)
    return f"; did you mean {' or '.join(candidates[c] for c in close)}?" if close else ""

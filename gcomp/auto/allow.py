"""The methods ``auto`` may choose from: ``allow="exact"``, ``"half"``, or the user's own list of specs."""
from __future__ import annotations

import difflib
from typing import Any, Sequence

from gcomp.core import ALLGATHER, ALLREDUCE
from gcomp.method import MethodUnit
from gcomp.registry import Nested, UnknownMethodError, available, from_spec

EXACT = ("identity",)  # pactrain joins them on a pruned model: its packed sum is the dense one's, losslessly
HALF = ("fp16", "bf16")
PRESETS = ("exact", "half")
PRICED = (ALLREDUCE, ALLGATHER)  # the collectives the choice prices from a bucket's counted calls and bytes alone
SEPARATOR = "|"  # between the specs of a list given as one string (``auto:allow=identity|fp16``)


class AllowList:
    """``allow``'s values: ``"exact"``, ``"half"``, or method specs, as a list or one string joined by ``|``;
    held as text (a preset's name, or the canonical specs joined by ``|``), so it prints and checkpoints."""

    def __str__(self) -> str:
        return f"'exact', 'half', or a list of method specs (in a string: joined by '{SEPARATOR}')"

    def convert(self, method: str, param: str, value: Any) -> str:
        if isinstance(value, str) and value.strip() in PRESETS:  # spaces dropped, as around a list's entries
            return value.strip()
        listed = value.split(SEPARATOR) if isinstance(value, str) else value
        if not isinstance(listed, (list, tuple)) or not all(isinstance(v, str) for v in listed):
            raise ValueError(f"{method}: parameter '{param}' must be {self}; got {listed!r}")
        specs = allowed_methods(list(listed), pruned=True, given=value)  # the checks and messages of every entry
        return SEPARATOR.join(Nested().convert(method, param, spec) for spec in specs)


def allowed_methods(allow: str | Sequence[str], pruned: bool, given: object = None) -> list[str]:
    """The specs ``auto`` chooses among, in tie-breaking order: a preset (``"exact"``: ``identity``, and ``pactrain``
    when ``pruned``, both equal to a dense all-reduce up to summation order; ``"half"`` adds ``fp16``, ``bf16``) or
    ``allow``'s specs, each stripped and checked as ``gcomp.create`` checks it, and refused if the choice cannot
    price its collective or it cannot hand over at a switch what it holds back. ``given``: ``allow`` as written."""
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
    for number, text in enumerate(specs, 1):
        name = text.partition(":")[0].strip()
        if not text:
            raise ValueError(f"auto: allow entry {number} of {given!r} is empty; list method specs, in a string "
                             f"joined by '|' (identity|fp16)")
        if name == "auto":
            raise ValueError("auto: allow cannot list auto itself")
        if name in PRESETS:
            held = ", ".join(EXACT + (HALF if name == "half" else ()))
            raise ValueError(f"auto: allow entry {text!r} is a preset, which stands alone (allow={name!r}); a list "
                             f"names methods only ({name!r} is {held}, with pactrain on a pruned model)")
        if name not in available():
            methods = ", ".join(n for n in available() if n != "auto")
            raise UnknownMethodError(f"auto: allow entry {text!r} is neither a preset ({', '.join(PRESETS)}) nor a "
                                     f"registered method ({methods}){_closest(name)}")
    if len(set(specs)) != len(specs):
        raise ValueError(f"auto: allow lists a method twice: {specs}")
    for text in specs:
        try:
            method = from_spec(text)
        except ValueError as err:
            raise ValueError(f"auto: allow entry {text!r}: {err}") from None
        if method.collective not in PRICED:
            raise ValueError(f"auto: allow entry {text!r} runs the {method.collective!r} collective, "
                             f"which auto cannot price yet; it chooses among {' and '.join(PRICED)} methods")
        if method.error_feedback and type(method).flush is MethodUnit.flush:
            raise ValueError(f"auto: allow entry {text!r} keeps gradient it did not send inside its codec and cannot "
                             "hand it to another method at a switch; leave its error feedback off")
    return specs


def _closest(name: str) -> str:
    """"; did you mean ...?" with the presets and methods closest to ``name`` (one differing in case first)."""
    candidates = {**{p: f"the preset {p!r}" for p in PRESETS}, **{m: repr(m) for m in available() if m != "auto"}}
    same = [c for c in candidates if c.lower() == name.strip().lower()]
    if same:
        return f"; did you mean {candidates[same[0]]}? Names are case-sensitive"
    close = difflib.get_close_matches(name.strip(), candidates, n=3, cutoff=0.4)
    return f"; did you mean {' or '.join(candidates[c] for c in close)}?" if close else ""

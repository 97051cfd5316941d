"""``auto``: the allowed method measured fastest on this link, per bucket (``gcomp.auto``)."""
from __future__ import annotations

from typing import Annotated, Any

from gcomp.auto.allow import PRESETS, allowed_methods
from gcomp.auto.method import AutoMethod
from gcomp.params import Range
from gcomp.registry import Nested, register

SEPARATOR = "|"  # between the specs of a list given as one string (``auto:allow=identity|fp16``)


class AllowList:
    """``allow``'s values: ``"exact"``, ``"half"``, or method specs, as a list or one string joined by ``|``;
    held as text (a preset's name, or the canonical specs joined by ``|``), so it prints and checkpoints."""

    def __str__(self) -> str:
        return f"'exact', 'half', or a list of method specs (in a string: joined by '{SEPARATOR}')"

    def convert(self, method: str, param: str, value: Any) -> str:
        given = value
        if isinstance(value, str) and value.strip() in PRESETS:  # spaces dropped, as around a list's entries
            return value.strip()
        if isinstance(value, str):
            value = value.split(SEPARATOR)
        if not isinstance(value, (list, tuple)) or not all(isinstance(v, str) for v in value):
            raise ValueError(f"{method}: parameter '{param}' must be {self}; got {value!r}")
        specs = allowed_methods(list(value), pruned=True, given=given)  # the checks and messages of every entry
        return SEPARATOR.join(Nested().convert(method, param, spec) for spec in specs)


@register("auto", paper="gcomp's own: alpha-beta link probe and measured codec times, chosen per bucket")
def auto(
    allow: Annotated[str, AllowList(), "methods it may choose: 'exact' (identity, and pactrain on a pruned model), "
                                       "'half' (adds fp16, bf16), or a list of specs"] = "exact",
    probe_every: Annotated[int, Range(1, None), "steps between checks of the measured waits against the link"] = 10,
    trials: Annotated[int, Range(1, None), "buckets each candidate reduces per layout while measuring"] = 5,
    margin: Annotated[float, Range(0, 1, high_open=True), "how much faster another method must be predicted to "
                                                           "switch to it"] = 0.1,
    reprobe_above: Annotated[float, Range(0, None, low_open=True), "drift of the waits (relative) that triggers a "
                                                                    "new probe of the link"] = 2.0,
) -> AutoMethod:
    """The method chosen per bucket from the link and the codecs it measures, and changed when the link
    changes: every allowed method runs a few steps, timed, the link is probed, and each bucket takes the one
    predicted fastest; the waits are watched and the link probed again when they drift."""
    preset = allow in PRESETS
    specs = allowed_methods(allow if preset else allow.split(SEPARATOR), pruned=True)
    return AutoMethod(specs, preset, probe_every, trials, margin, reprobe_above)

"""The methods ``auto`` may choose from: ``allow="exact"``, ``"half"``, or the user's own list of specs."""
from __future__ import annotations

from typing import Sequence

from gcomp.core import ALLGATHER, ALLREDUCE, Compressor
from gcomp.method import Method
from gcomp.registry import create, parse_spec

EXACT = ("identity",)  # pactrain joins them on a pruned model: its packed sum is the dense one's, losslessly
HALF = ("fp16", "bf16")
PRESETS = ("exact", "half")
# the collectives whose cost the choice can price from a bucket's counted calls and bytes alone
PRICED = (ALLREDUCE, ALLGATHER)


def allowed_methods(allow: str | Sequence[str], pruned: bool) -> list[str]:
    """The specs ``auto`` chooses among, in the order ties are broken: ``"exact"`` (``identity``, and
    ``pactrain`` when ``pruned``: both equal a dense all-reduce up to summation order), ``"half"`` (those and
    ``fp16``, ``bf16``), or ``allow`` itself, a list of method specs, each checked here as ``gcomp.create``
    checks it (an unknown name names the closest ones). Raises ``ValueError`` for anything else: a preset
    misspelt, an empty list, a spec twice, ``auto`` itself, a method whose collective the choice cannot
    price (point-to-point schedules, hierarchical ones), or one whose codec holds back gradient it cannot hand
    over at a switch (``Compressor.flush``)."""
    if isinstance(allow, str):
        if allow not in PRESETS:
            raise ValueError(f"auto: allow must be one of {', '.join(map(repr, PRESETS))} or a list of method "
                             f"specs; got {allow!r}")
        exact = list(EXACT) + (["pactrain"] if pruned else [])
        return exact if allow == "exact" else exact + list(HALF)
    specs = [str(s).strip() for s in allow]
    if not specs:
        raise ValueError("auto: allow lists no method")
    if len(set(specs)) != len(specs):
        raise ValueError(f"auto: allow lists a method twice: {specs}")
    for text in specs:
        if text.partition(":")[0].strip() == "auto":
            raise ValueError("auto: allow cannot list auto itself")
        name, params = parse_spec(text)
        try:
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

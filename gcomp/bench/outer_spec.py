"""An outer loop as ``gcomp bench --outer`` names it: ``diloco:every=50,method=fp16`` and its parameters.

A spec is ``diloco`` or ``diloco:key=value,...``; ``method`` is a nested gcomp method spec, which holds ``:`` and
``,`` itself, so it takes the rest of the spec (write it last: ``diloco:every=50,method=topk:ratio=0.05``) or
sits in brackets anywhere (``diloco:method=[topk:ratio=0.05],every=50``). The keys:

- ``every``: inner steps between outer syncs (``sync_every``, H), default 50;
- ``method``: what reduces the outer gradient, a gcomp method spec (default ``identity``);
- ``fragments``, ``overlap``: Streaming DiLoCo's fragment count (at most ``every``) and the inner steps a
  fragment's reduction is in flight (below ``every / fragments``; defaults 1 and 0: plain DiLoCo);
- ``lr``, ``momentum``: the outer SGD's, Nesterov when momentum is above 0 (the DiLoCo paper's 0.7 and 0.9);
- ``inner``: ``sgd`` (default: the optimizer every per-step method of the race runs, SGD with the race's
  ``--lr`` and momentum 0.9, so that the outer loop is the one difference) or ``adamw`` (as the DiLoCo paper;
  torch's AdamW defaults, lr 1e-3, weight decay 0.01);
- ``inner_lr``: the inner optimizer's lr (default: ``--lr`` for sgd, 1e-3 for adamw).
"""
from __future__ import annotations

import difflib
import math
from dataclasses import dataclass, field

import gcomp
from gcomp.outer import arguments as outer_arguments
from gcomp.registry import parse_spec

OUTER_LOOPS = ("diloco",)
INNER = ("sgd", "adamw")
ADAMW_LR = 1e-3  # torch.optim.AdamW's default
DEFAULTS = {"every": 50, "method": "identity", "fragments": 1, "overlap": 0, "lr": 0.7, "momentum": 0.9,
            "inner": "sgd", "inner_lr": None}


@dataclass(frozen=True)
class OuterMethod:
    """One outer-loop run of the race: ``label`` as written and its ``params`` (every key of ``DEFAULTS``,
    filled in). The worker trains each rank's model alone with the inner optimizer and calls
    ``gcomp.outer.DiLoCo.step`` after every inner step (``gcomp.bench.outer_run``)."""

    label: str
    name: str = "diloco"
    params: dict = field(default_factory=dict)
    outer = True
    is_torch = False
    prunes = False
    one_bucket = False

    @property
    def collective(self) -> str:
        name, params = parse_spec(self.params["method"])
        return f"every {self.params['every']}: {gcomp.create(name, **params).collective or name}"

    def inner_lr(self, race_lr: float) -> float:
        """The inner optimizer's learning rate: as given, else the race's for sgd and AdamW's default."""
        if self.params["inner_lr"] is not None:
            return self.params["inner_lr"]
        return race_lr if self.params["inner"] == "sgd" else ADAMW_LR


def is_outer(text: str) -> bool:
    """Whether ``text`` names an outer loop (``diloco`` or ``diloco:...``) rather than a per-step method."""
    return text.strip().partition(":")[0] in OUTER_LOOPS


def parse_outer(text: str) -> OuterMethod:
    """``text`` as an :class:`OuterMethod`; a ValueError saying what is wrong (with close names) otherwise."""
    text = text.strip()
    name, _, rest = text.partition(":")
    if name not in OUTER_LOOPS:
        raise ValueError(f"--outer {text!r}: unknown outer loop {name!r}{_hint(name, OUTER_LOOPS)}; "
                         f"choose one of {', '.join(OUTER_LOOPS)} (diloco:every=50,method=fp16)")
    given: dict = {}
    while rest.strip():
        key, eq, value = rest.partition("=")
        key = key.strip()
        if not eq or not key:
            raise ValueError(f"--outer {text!r}: {rest!r} is not key=value (diloco:every=50,method=fp16)")
        if key not in DEFAULTS:
            raise ValueError(f"--outer {text!r}: unknown key {key!r}{_hint(key, DEFAULTS)}; {name} takes "
                             f"{', '.join(DEFAULTS)}")
        if key in given:
            raise ValueError(f"--outer {text!r}: {key} is given twice")
        if key == "method" and value.lstrip().startswith("["):
            value = value.lstrip()
            end = value.find("]")
            if end < 0:
                raise ValueError(f"--outer {text!r}: method=[ has no closing ]")
            value, rest = value[1:end], value[end + 1:]
            if rest.strip() and not rest.lstrip().startswith(","):
                raise ValueError(f"--outer {text!r}: a ',' must follow method=[...]")
            rest = rest.lstrip()[1:]
        elif key == "method":
            rest = ""  # the rest of the spec is the method's
        else:
            value, _, rest = value.partition(",")
        given[key] = _value(text, key, value.strip())
    params = {**DEFAULTS, **given}
    _check(text, params)
    return OuterMethod(text, name, params)


def _value(text: str, key: str, value: str):
    if key in ("inner", "method"):
        return value.lower() if key == "inner" else value
    kind, low = {"every": (int, 1), "fragments": (int, 1), "overlap": (int, 0), "lr": (float, 0.0),
                 "momentum": (float, 0.0), "inner_lr": (float, 0.0)}[key]
    try:
        number = kind(value)
    except ValueError:
        number = None
    strict = key in ("lr", "inner_lr")
    if number is None or not math.isfinite(number) or number < low or (strict and number == low):
        what = "a whole number" if kind is int else "a number"
        raise ValueError(f"--outer {text!r}: {key} must be {what} {'above' if strict else 'of at least'} "
                         f"{low:g}; got {value!r}")
    return number


def _check(text: str, params: dict) -> None:
    if params["inner"] not in INNER:
        raise ValueError(f"--outer {text!r}: inner must be one of {', '.join(INNER)}"
                         f"{_hint(params['inner'], INNER)}; got {params['inner']!r}")
    if params["momentum"] >= 1:
        raise ValueError(f"--outer {text!r}: momentum must be in [0, 1); got {params['momentum']!r}")
    if params["fragments"] > params["every"]:
        raise ValueError(f"--outer {text!r}: fragments ({params['fragments']}) above every ({params['every']}): "
                         "each fragment needs its own step of the H")
    if params["overlap"] * params["fragments"] >= params["every"]:  # gcomp.outer's rule, in the spec's words
        raise ValueError(f"--outer {text!r}: overlap ({params['overlap']}) must be below every / fragments "
                         f"({params['every']} / {params['fragments']}): a fragment lands before the next leaves")
    method = params["method"]
    if method.startswith("torch:") or method.partition(":")[0] in OUTER_LOOPS:
        raise ValueError(f"--outer {text!r}: method must be a gcomp method (gcomp list); got {method!r}")
    try:
        outer_arguments.outer_method(method)  # unknown names (with close names), keys, values; reads the model
    except ValueError as err:
        swallowed = [k for k in DEFAULTS if f",{k}=" in method]
        if swallowed:
            raise ValueError(f"--outer {text!r}: method takes the rest of the spec, so {', '.join(swallowed)} "
                             f"went to it: put method last, or in brackets (method=[{method.split(',')[0]}])") \
                from None
        raise ValueError(f"--outer {text!r}: method {method!r}: {err}") from None


def _hint(word: str, choices) -> str:
    close = difflib.get_close_matches(word, list(choices), n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""

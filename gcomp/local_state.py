"""What ``install`` returns where there is nothing to compress: one process, no DDP model.

A script that also runs on one process (``python train.py``, a debugging run) keeps working unchanged: the state
has the ``stats`` of a hook that sent nothing (all zeros), ``compression_ratio`` 1.0, and says what happened
when printed. It is not None, so ``state.stats`` never fails, and not a hook state, so nothing pretends to
have compressed.
"""
from __future__ import annotations

from typing import Any

from gcomp.method import MethodUnit
from gcomp.run_state import STAT_KEYS, method_spec


class NotDistributed:
    """The state of a method installed where there is nothing to compress (one process, no DDP model).

    ``distributed`` is False; ``stats`` holds every key a hook state's has, at zero; ``compression_ratio`` is
    1.0; ``state_dict()`` is empty and ``load_state_dict`` accepts only an empty one (a checkpoint of a
    distributed run holds every rank's part, which one process cannot continue). ``str(state)`` reads
    ``gcomp: not distributed: nothing compressed (...)``.
    """

    distributed = False

    def __init__(self, method: MethodUnit, why: str):
        self.method = method
        self.why = why
        self.stats: dict[str, Any] = {key: 0 for key in STAT_KEYS}

    @property
    def compression_ratio(self) -> float:
        return 1.0

    def describe(self) -> str:
        return f"gcomp: not distributed: nothing compressed ({self.method.name}; {self.why})"

    __str__ = describe

    def __repr__(self) -> str:
        return f"NotDistributed({method_spec(self.method)}, {self.why!r})"

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state:
            raise ValueError("gcomp: this run is not distributed (nothing compressed) but the checkpoint holds a "
                             "distributed run's gcomp state: resume it with as many processes as saved it")

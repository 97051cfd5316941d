"""``Composite``: a method made of other methods (``hierarchical`` and ``prunex`` run one between node leaders,
``auto`` picks one of several per bucket); its traits and checkpoint protocol follow from its parts."""
from __future__ import annotations

import warnings
from abc import abstractmethod

from gcomp.method import MethodUnit


class Composite(MethodUnit):
    """A ``MethodUnit`` whose ``parts`` are methods: lossless when all are, stateful (and reading the model,
    depending on the bucket layout, keeping error feedback) when any is, decoded alone when all are; its state
    is replicated when every part's is. A subclass says how a bucket goes through its parts (``reduce``) and how
    their states are filed (``state_dict`` and the rest of ``gcomp.core.Checkpointed``)."""

    @property
    @abstractmethod
    def parts(self) -> list[MethodUnit]:
        """The methods it is made of."""

    @property
    def decodes_alone(self) -> bool:
        return all(p.decodes_alone for p in self.parts)

    @property
    def lossless(self) -> bool:
        return all(p.lossless for p in self.parts)

    @property
    def stateful(self) -> bool:
        return any(p.stateful for p in self.parts)

    @property
    def reads_model(self) -> bool:
        return any(p.reads_model for p in self.parts)

    @property
    def depends_on_layout(self) -> bool:
        return any(p.depends_on_layout for p in self.parts)

    @property
    def error_feedback(self) -> bool:
        return any(p.error_feedback for p in self.parts)

    @property
    def host_syncs(self) -> int:
        """Each bucket goes through its parts: at most what all of them may make."""
        return sum(p.host_syncs for p in self.parts)

    @property
    def keeps_state(self) -> bool:
        return any(p.keeps_state for p in self.parts)

    @property
    def replicated(self) -> bool:
        return all(p.replicated for p in self.parts)

    def watch(self, ddp) -> None:
        for part in self.parts:
            part.watch(ddp)

    @property
    def compressor(self) -> "Composite":
        """Deprecated: until 0.1 a composite was a ``Method`` whose compressor held what it holds itself now."""
        warnings.warn(f"{type(self).__name__}.compressor: a composite method has no compressor; what its compressor "
                      "held (inner methods, events, choices) is on the method itself", DeprecationWarning, stacklevel=2)
        return self

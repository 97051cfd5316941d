"""A fragment's outer reduction between its launch and its application (``overlap`` inner steps later)."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from gcomp.collectives.launch import settle


@dataclass
class Pending:
    """A fragment's reduction in flight (``future``: a future of its buckets' futures), or resolved (``means``,
    the reduced outer gradient per bucket, as a checkpoint holds it)."""

    fragment: int
    apply_at: int
    future: torch.futures.Future | None = None
    means: list[torch.Tensor] | None = None

    def result(self) -> list[torch.Tensor]:
        """The reduced outer gradient per bucket; waits for it, raising the collective's error (a dead peer)."""
        if self.means is None:
            self.means = [f.wait() for f in self.future.wait()]
            settle()
        return self.means

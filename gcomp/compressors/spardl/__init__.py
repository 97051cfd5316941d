"""The spardl family: SparDL (Zhao et al., arXiv 2304.00737), sparse reduce-scatter and all-gather with global
residual collection, for any number of workers (``schedule``: the round programs; ``codec``: the method's codec)."""
from __future__ import annotations

from typing import Annotated

from gcomp.collectives.program import ProgramCommunicator
from gcomp.collectives.sparse_wire import PositionsParam, ValuesParam
from gcomp.compressors.spardl.codec import SparDLCompressor
from gcomp.core import NoMemory
from gcomp.method import Method
from gcomp.params import Range
from gcomp.registry import register


@register("spardl", paper="Zhao et al., SparDL, arXiv 2304.00737 (2023)")
def spardl(density: Annotated[float, Range(0, 1, low_open=True), "fraction of each block's entries sent"] = 0.01,
           teams: Annotated[int, Range(1, None), "teams for Spar-All-Gather (must divide the workers; FSDP2: 1, its "
                                                 "reduce-scatter has no all-gather across teams)"] = 1,
           positions: PositionsParam = "coded", values: ValuesParam = "fp32") -> Method:
    """SparDL: top-k per block by Spar-Reduce-Scatter (any worker count), optional Spar-All-Gather across
    teams, Bruck all-gather, and global residual collection; point-to-point messages only."""
    return Method(SparDLCompressor(density, teams, positions, values), NoMemory(), ProgramCommunicator())

"""Communicators, the collectives a payload travels by, and the codec protocols they take: all-reduce and chained
all-reduce (``reduce``), all-gather and all-to-all (``gather``), two phases (``two_phase``), a sizes round first
(``sized``), point-to-point programs (``program``); how collectives are launched and counted (``launch``)."""
from gcomp.collectives.gather import AllgatherCommunicator
from gcomp.collectives.reduce import AllreduceCommunicator, ChainedAllreduceCommunicator, ChainedCompressor

__all__ = ["AllgatherCommunicator", "AllreduceCommunicator", "ChainedAllreduceCommunicator", "ChainedCompressor"]

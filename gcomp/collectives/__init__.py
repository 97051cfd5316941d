"""Communicators: the collectives a payload travels by."""
from gcomp.collectives.allgather import AllgatherCommunicator
from gcomp.collectives.allreduce import AllreduceCommunicator

__all__ = ["AllgatherCommunicator", "AllreduceCommunicator"]

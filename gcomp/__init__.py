"""gcomp: pluggable gradient compression for PyTorch DistributedDataParallel and FSDP2.

    import gcomp
    state = gcomp.install(ddp_model, "topk", ratio=0.01)   # one hook, any registered method
    state, hook = gcomp.comm_hook("topk", ratio=0.01)       # or register it yourself (Lightning's DDPStrategy)
"""
from gcomp.bucket import BucketInfo
from gcomp.core import (ALLGATHER, ALLREDUCE, EXACT, HIERARCHICAL, LARGEST, POINT_TO_POINT, UNBIASED, Communicator,
                        Compressor, Fidelity, Keeps, Memory, NoMemory, Payload, ResidualMemory, Traits, contraction,
                        relative)
from gcomp.elastic import end_process
from gcomp.hook import HookState
from gcomp.installer import NotDistributed, comm_hook, install
from gcomp.method import Method, MethodUnit
from gcomp.params import OneOf, Range
from gcomp.registry import UnknownMethodError, available, create, describe, register, spec

from gcomp import compressors, pruning  # noqa: E402,F401  (registers the built-in methods)
from gcomp import outer  # noqa: E402,F401  (gcomp.outer.DiLoCo)

__version__ = "0.1.0"

__all__ = ["ALLGATHER", "ALLREDUCE", "BucketInfo", "Communicator", "Compressor", "EXACT", "Fidelity", "HIERARCHICAL",
           "HookState", "Keeps", "LARGEST", "Memory", "Method", "MethodUnit", "NoMemory", "NotDistributed", "OneOf",
           "POINT_TO_POINT", "Payload", "Range", "ResidualMemory", "Traits", "UNBIASED", "UnknownMethodError",
           "available", "comm_hook", "contraction", "create", "describe", "end_process", "install", "register",
           "relative", "spec"]

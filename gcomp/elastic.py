"""A torchrun process around gcomp (docs/checkpoints-and-faults.md): a process group that survives torchrun's
restarts (``init_process_group``: after a restart the store still holds the dead attempt's keys, so gloo's
connectFullMesh is refused; each attempt gets a key space of its own), and an end that does not abort
(``end_process``: a backend thread still in a collective's callbacks at interpreter shutdown aborts the process).
"""
from __future__ import annotations

import os
import sys
from datetime import timedelta

import torch.distributed as dist

_NEEDED = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def attempt() -> int:
    """torchrun's restart count (0 on the first attempt, and outside torchrun)."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))


def init_process_group(backend: str = "gloo", timeout: timedelta = timedelta(seconds=60)) -> int:
    """``torch.distributed.init_process_group`` for a script started by torchrun, on this attempt's own key space
    of torchrun's store; returns the attempt (``TORCHELASTIC_RESTART_COUNT``). Raises ``RuntimeError`` naming
    the variables torchrun sets if any is missing (the script was not started by torchrun)."""
    missing = [name for name in _NEEDED if name not in os.environ]
    if missing:
        raise RuntimeError(f"gcomp.elastic.init_process_group: {', '.join(missing)} not set: start the script with "
                           "torchrun (or set them as torchrun does)")
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"  # torchrun's agent hosts it
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world_size=world,
                          is_master=not agent_store and rank == 0, timeout=timeout)
    dist.init_process_group(backend, store=dist.PrefixStore(f"attempt{attempt()}", store), rank=rank,
                            world_size=world, timeout=timeout)
    return attempt()


def end_process(code: int = 0, timeout: float = 5.0) -> None:
    """Settle gcomp's collectives (``timeout`` seconds at most), flush stdout and stderr, and end the process with
    ``code``, skipping the interpreter's shutdown (``atexit`` handlers and finalisers do not run: call it last)."""
    from gcomp.collectives.launch import settle  # only when ending: importing gcomp stays light

    settle(timeout=timeout)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)

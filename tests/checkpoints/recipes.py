"""How each checkpoint fixture is built and trained: models, batches, the gcomp state, the training loop.

Everything here goes through gcomp's public API only (``gcomp.install``, ``gcomp.comm_hook``,
``gcomp.fsdp.replicate``, ``gcomp.outer.DiLoCo``, ``gcomp.pruning.StructuredADMM``) and torch's own
(``torch.nn.utils.prune``, ``fully_shard``), so that ``make_fixtures`` (which saves the checkpoints) and
``test_fixtures_load`` (which loads them) build the very same thing, and keep doing so after gcomp's internals
move. Nothing is imported from ``tests.models`` or ``gcomp.testing`` either: the model recipes are copied here, so
that a fixture's model stays the one it was saved with.

A case (one entry of ``data/cases.json``) is a plain dict:

    {"label": file name without ".pt", "kind": "ddp" | "comm_hook" | "fsdp" | "hsdp" | "diloco",
     "method": name, "params": {...}, "world": ranks, "model": a MODELS key, "steps": steps trained before saving,
     "ddp": DistributedDataParallel kwargs (ddp, comm_hook),
     "shard_method"/"shard_params", "replicas": the method within a replica, the replica count (hsdp; the saved
     state is the replica method's: ``{"shard<i>": gather_state_dict()}``, one per shard index, see ``Run.saved``),
     "diloco": DiLoCo keyword arguments (sync_every, fragments, overlap, bucket_mb)}
"""
from __future__ import annotations

import json
import pathlib

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.nn.utils import prune

import gcomp
import gcomp.fsdp
import gcomp.outer

DATA = pathlib.Path(__file__).parent / "data"
CASES_FILE = DATA / "cases.json"
LR = 0.1
FSDP_SIZES = ((11, 13), (13, 7), (7, 3))  # odd sizes: FSDP pads dim 0 on 2 and 4 ranks


# --- models ---------------------------------------------------------------------------------------------------

def mlp(seed: int = 0) -> nn.Module:
    """20 inputs, two hidden layers of 32, 10 outputs (2,058 parameters); the same weights for the same seed."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(20, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 10))


def pruned_mlp(seed: int = 0) -> nn.Module:
    """``mlp`` with its first two Linear weights pruned by magnitude at 0.5 (torch's prune); the last is whole."""
    model = mlp(seed)
    for i in (0, 2):
        prune.l1_unstructured(model[i], "weight", amount=0.5)
    return model


def structured_cnn(seed: int = 0) -> nn.Module:
    """A small CNN on 1x8x8 images with half the filters of both convolutions pruned (``StructuredADMM``)."""
    from gcomp.pruning import StructuredADMM

    torch.manual_seed(seed)
    model = nn.Sequential(nn.Conv2d(1, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 8, 3, padding=1), nn.ReLU(),
                          nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 10))
    StructuredADMM(model, sparsity=0.5).prune()
    return model


def fsdp_mlp(seed: int = 0, pruned: bool = False) -> nn.Module:
    """Linear 11x13, 13x7, 7x3 (Tanh between; 1 layer per FSDP module, then the root; ``Run`` shards it), the first
    two pruned at 0.5 when asked (before sharding)."""
    torch.manual_seed(seed)
    layers = []
    for fan_in, fan_out in FSDP_SIZES:
        layers += [nn.Linear(fan_in, fan_out), nn.Tanh()]
    model = nn.Sequential(*layers[:-1])
    if pruned:
        for layer in model[::2][:2]:
            prune.l1_unstructured(layer, "weight", 0.5)
    return model


def fsdp_pruned_mlp(seed: int = 0) -> nn.Module:
    """``fsdp_mlp`` with its first two Linear weights pruned by magnitude at 0.5 (before sharding)."""
    return fsdp_mlp(seed, pruned=True)


MODELS = {"mlp": mlp, "pruned_mlp": pruned_mlp, "structured_cnn": structured_cnn, "fsdp_mlp": fsdp_mlp,
          "fsdp_pruned_mlp": fsdp_pruned_mlp}


def batch(model_name: str, step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A deterministic batch of ``model_name``'s inputs and targets, differing per step and rank."""
    g = torch.Generator().manual_seed(1000 * step + rank)
    if model_name == "structured_cnn":
        x = torch.randn(8, 1, 8, 8, generator=g)
        return x, (x.mean(dim=(1, 2, 3)) > 0).long() + 2 * (x[:, 0, 0, 0] > 0).long()
    if model_name.startswith("fsdp"):
        return torch.randn(8, FSDP_SIZES[0][0], generator=g), torch.randn(8, FSDP_SIZES[-1][1], generator=g)
    return torch.randn(16, 20, generator=g), torch.randint(0, 10, (16,), generator=g)


def loss_of(model_name: str, out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    if model_name.startswith("fsdp"):
        return nn.functional.mse_loss(out, y)
    return nn.functional.cross_entropy(out, y)


# --- labels and the case list -------------------------------------------------------------------------------

def spec(method: str, params: dict) -> str:
    """The method spec, ``name:key=value,...`` (bools lower case, as the command line writes them)."""
    if not params:
        return method
    def text(v):
        return str(v).lower() if isinstance(v, bool) else str(v)
    return method + ":" + ",".join(f"{k}={text(v)}" for k, v in params.items())


def label(kind: str, method: str, params: dict, suffix: str = "") -> str:
    """A file-system-safe name: ``<kind>-<spec>`` with ``:`` as ``+`` (letters, digits, ``_.,=+-`` only)."""
    name = f"{kind}-{spec(method, params).replace(':', '+')}{suffix}"
    bad = sorted({c for c in name if not (c.isascii() and (c.isalnum() or c in "_.,=+-"))})
    if bad:
        raise ValueError(f"label {name!r}: characters {bad} are not file-system safe")
    return name


def load_cases() -> list[dict]:
    return json.loads(CASES_FILE.read_text())["cases"]


# --- one case's model, state and training -------------------------------------------------------------------

class Run:
    """One case built on this rank: the model, the state whose checkpoint is saved (``state``), the optimizer."""

    def __init__(self, case: dict):
        self.case = case
        self.kind, self.model_name = case["kind"], case["model"]
        self.outer = None
        net = MODELS[self.model_name]()
        method, params = case["method"], case["params"]
        if self.kind == "ddp":
            self.model = DistributedDataParallel(net, **case.get("ddp", {}))
            self.state = gcomp.install(self.model, method, **params)
        elif self.kind == "comm_hook":  # no model=: the hook knows the parameters by their place only
            self.model = DistributedDataParallel(net, **case.get("ddp", {}))
            self.state, hook = gcomp.comm_hook(method, **params)
            self.model.register_comm_hook(self.state, hook)
        elif self.kind == "fsdp":
            from torch.distributed.device_mesh import init_device_mesh

            self.model = _sharded(net, init_device_mesh("cpu", (dist.get_world_size(),)))
            self.state = gcomp.install(self.model, method, **params)
        elif self.kind == "hsdp":  # gcomp's HSDP: shard within a replica, a gcomp method across replicas
            from torch.distributed.device_mesh import init_device_mesh

            replicas = case["replicas"]
            mesh = init_device_mesh("cpu", (replicas, dist.get_world_size() // replicas),
                                    mesh_dim_names=("replicate", "shard"))
            self.shard_index = mesh["shard"].get_local_rank()
            self.model = _sharded(net, mesh["shard"])
            self.shard_state = gcomp.install(self.model, case["shard_method"], **case["shard_params"])
            self.state = gcomp.fsdp.replicate(self.shard_state, mesh["replicate"].get_group(), method, **params)
        elif self.kind == "diloco":
            self.model = net
            self.state = self.outer = gcomp.outer.DiLoCo(net, method=spec(method, params), **case["diloco"])
        else:
            raise ValueError(f"unknown case kind {self.kind!r}")
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=LR)

    def saved(self):
        """What the fixture file holds (a collective; rank 0's return value is saved): ``gather_state_dict()``;
        for HSDP, whose replica states are one per shard index (each over its own replicate group), a dict
        ``{"shard<i>": that group's gather_state_dict()}``."""
        gathered = self.state.gather_state_dict()
        if self.kind != "hsdp":
            return gathered
        every = [None] * dist.get_world_size()
        dist.all_gather_object(every, (self.shard_index, gathered))
        return {f"shard{i}": state for i, state in sorted(dict(every).items())}

    def load(self, saved) -> None:
        """``state.load_state_dict`` of this rank's state in ``saved`` (a fixture file, as ``saved()`` made it)."""
        self.state.load_state_dict(saved[f"shard{self.shard_index}"] if self.kind == "hsdp" else saved)

    def train(self, start: int, steps: int) -> None:
        rank = dist.get_rank()
        for step in range(start, start + steps):
            x, y = batch(self.model_name, step, rank)
            self.optimizer.zero_grad()
            loss_of(self.model_name, self.model(x), y).backward()
            self.optimizer.step()
            if self.outer is not None:
                self.outer.step()

    def parameters_finite(self) -> bool:
        out = True
        for p in self.model.parameters():
            t = p.full_tensor() if hasattr(p, "full_tensor") else p  # a collective for FSDP's DTensors
            out &= bool(torch.isfinite(t.detach()).all())
        return out

    def close(self) -> None:
        dist.barrier()
        del self.model, self.state, self.outer, self.optimizer


def _sharded(net: nn.Module, mesh) -> nn.Module:
    from torch.distributed.fsdp import fully_shard

    for layer in net:
        if any(True for _ in layer.parameters()):
            fully_shard(layer, mesh=mesh)
    fully_shard(net, mesh=mesh)
    return net

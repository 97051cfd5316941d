"""Rank jobs for the FSDP2 tests (tests/fsdp/test_fsdp.py): each job runs several methods or checks in one call, so
the rank pools of ``tests.distributed`` start once."""
from __future__ import annotations

import io

import torch
import torch.distributed as dist
import torch.nn.utils.prune as prune
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import gcomp
import gcomp.fsdp
from gcomp.collectives import bitpack
from gcomp.collectives.program import message_nbytes
from gcomp.collectives.sparse_wire import SparseWire
from gcomp.compressors.spardl.schedule import reduce_scatter_rounds
from gcomp.compressors.pactrain import scale_grid

STEPS = 10
PRUNE = 0.5
SIZES = ((11, 13), (13, 7), (7, 3))  # odd sizes: FSDP pads dim 0 on 2-4 ranks


def build(pruned: bool, seed: int = 0) -> torch.nn.Module:
    """A small MLP, pruned (before fully_shard) when asked, sharded per layer and at the root."""
    torch.manual_seed(seed)
    layers = []
    for fan_in, fan_out in SIZES:
        layers += [torch.nn.Linear(fan_in, fan_out), torch.nn.Tanh()]
    model = torch.nn.Sequential(*layers[:-1])
    if pruned:  # the order: prune, then fully_shard, then gcomp.install
        for layer in model[::2][:2]:
            prune.l1_unstructured(layer, "weight", PRUNE)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for layer in model[::2]:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(8, SIZES[0][0], generator=g), torch.randn(8, SIZES[-1][1], generator=g)


def train(model, steps: int, start: int = 0, opt=None):
    opt = opt or torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    for step in range(start, start + steps):
        x, y = batch(step, dist.get_rank())
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    return opt


def full_params(model) -> dict[str, torch.Tensor]:
    return {n: p.full_tensor().detach().clone() for n, p in model.named_parameters()}


def effective_zeros(model) -> dict[str, bool]:
    """Per pruned layer: whether weight_orig * weight_mask is zero wherever the mask is."""
    out = {}
    for name, module in model.named_modules():
        if hasattr(module, "weight_mask"):
            w = module.weight_orig.full_tensor() * module.weight_mask
            out[name] = bool((w[module.weight_mask == 0] == 0).all())
    return out


def layout_rows(model) -> list[list[int]]:
    """Per FSDP module with parameters: the entries of each parameter in one row (dim 0 padded)."""
    world = dist.get_world_size()
    out = []
    for comm in model._gcomp_state.comms:
        out.append([-(-s[0] // world) * (s[1] if len(s) > 1 else 1) for s in comm.layout.sizes])
    return out


def kept_per_row(model) -> list[list[int]]:
    """Per FSDP module: kept entries of each destination row (the test's own count, from the masks); None for a
    module without masks."""
    world = dist.get_world_size()
    out = []
    names = {id(p): n for n, p in model.named_parameters()}
    for comm in model._gcomp_state.comms:
        counts, masked = [0] * world, False
        for name, size in zip(comm.layout.names, comm.layout.sizes):
            module_name, _, attr = name.rpartition(".")
            module = model.get_submodule(module_name)
            mask = getattr(module, attr.removesuffix("_orig") + "_mask", None) if attr.endswith("_orig") else None
            masked |= mask is not None
            rows = -(-size[0] // world)
            keep = torch.ones(size) if mask is None else (mask != 0).float()
            for r in range(world):
                counts[r] += int(keep[r * rows:(r + 1) * rows].sum())
        out.append(counts if masked else None)
    del names
    return out


def expected_bytes(name: str, params: dict, model) -> int:
    """Bytes one step hands to collectives, by the method's formula (fp32 gradients)."""
    world, total = dist.get_world_size(), 0
    for rows, kept in zip(layout_rows(model), kept_per_row(model)):
        width = sum(rows)
        if name in ("identity", None):
            total += world * width * 4
        elif name in ("fp16", "bf16"):
            total += world * width * 2
        elif name == "pactrain" and params.get("ternary") and kept is not None:  # a one-round step
            words = bitpack.packed_words(max(kept), bitpack.lane_bits(world))
            total += 8 * world * (words + scale_grid.hist_words(len(rows), world) + 3)
        elif name == "pactrain":  # a module with no mask keeps everything: it stays dense
            total += world * (max(kept) + 1) * 4 if kept is not None else world * width * 4
        elif name == "randomk":
            total += world * (max(1, int(width * params.get("ratio", 0.01))) + 1) * 4
        elif name == "spardl":
            k = max(1, int(width * params.get("density", 0.01)))
            wire = SparseWire(params.get("positions", "coded"), params.get("values", "fp32"))  # coded by default
            total += sum(message_nbytes(wire.sections(width, k, torch.float32, count))
                         for _, count in reduce_scatter_rounds(world))
    return total


RUNS = [("plain", None, {}, False), ("plain-pruned", None, {}, True), ("identity", "identity", {}, False),
        ("fp16", "fp16", {}, False), ("bf16", "bf16", {}, False), ("pactrain", "pactrain", {}, True),
        ("pactrain-ternary", "pactrain", {"ternary": True}, True),
        ("randomk", "randomk", {"ratio": 0.3}, False), ("spardl", "spardl", {"density": 0.3}, False)]


def job_train(runs=RUNS) -> dict:
    """Every run of ``runs`` trained ``STEPS`` steps: full parameters, stats, bytes of the last step by the
    method's formula, pruned weights still zero."""
    out = {}
    for label, name, params, pruned in runs:
        model = build(pruned)
        state = gcomp.install(model, name, **params) if name else None
        opt = train(model, STEPS - 1)
        before = dict(state.stats) if state else None
        train(model, 1, start=STEPS - 1, opt=opt)
        last = {k: state.stats[k] - before[k] for k in ("bytes_sent", "bytes_dense")} if state else None
        out[label] = {"params": full_params(model), "zeros": effective_zeros(model),
                      "stats": dict(state.stats) if state else None, "last": last,
                      "expected_last": expected_bytes(name, params, model) if state else None,
                      "dense_last": expected_bytes("identity", {}, model) if state else None}
    return out


def job_resume(runs) -> dict:
    """Per run: 3 steps, a checkpoint (gcomp's state through torch.save / torch.load(weights_only=True), the
    model's and optimizer's kept in memory), 3 more on a fresh model, against 6 steps straight."""
    out = {}
    for label, name, params, pruned in runs:
        straight = build(pruned)
        gcomp.install(straight, name, **params)
        train(straight, 6)
        model = build(pruned)
        state = gcomp.install(model, name, **params)
        opt = train(model, 3)
        buffer = io.BytesIO()
        torch.save(state.state_dict(), buffer)
        saved_model = {k: v.detach().clone() for k, v in model.state_dict().items()}
        saved_opt = opt.state_dict()
        resumed = build(pruned, seed=1)  # other initial weights: the checkpoint must bring them back
        resumed.load_state_dict(saved_model)
        resumed_state = gcomp.install(resumed, name, **params)
        resumed_state.load_state_dict(torch.load(io.BytesIO(buffer.getvalue()), weights_only=True))
        opt2 = torch.optim.SGD(resumed.parameters(), lr=0.05, momentum=0.9)
        opt2.load_state_dict(saved_opt)
        train(resumed, 3, start=3, opt=opt2)
        a, b = full_params(straight), full_params(resumed)
        out[label] = {"equal": all(torch.equal(a[k], b[k]) for k in a), "iteration": resumed_state.iteration,
                      "keys": sorted(torch.load(io.BytesIO(buffer.getvalue()), weights_only=True))}
    return out


def build_hsdp(mesh, native: bool) -> torch.nn.Module:
    """The MLP sharded on a (replicate, shard) mesh: native HSDP (the 2-D mesh), or on its shard dimension only."""
    torch.manual_seed(0)
    layers = []
    for fan_in, fan_out in SIZES:
        layers += [torch.nn.Linear(fan_in, fan_out), torch.nn.Tanh()]
    model = torch.nn.Sequential(*layers[:-1])
    on = mesh if native else mesh["shard"]
    for layer in model[::2]:
        fully_shard(layer, mesh=on)
    fully_shard(model, mesh=on)
    return model


def job_hsdp() -> dict:
    """On 4 ranks, 2 replicas x 2 shards: native HSDP against gcomp's (identity within a replica, identity or fp16
    across replicas); the replica method's bytes; native HSDP refused by gcomp.install."""
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    out = {}
    native = build_hsdp(mesh, True)
    train(native, STEPS)
    out["native"] = full_params(native)
    try:
        gcomp.install(build_hsdp(mesh, True), "identity")
    except ValueError as err:
        out["refused"] = str(err)
    for label, across in (("identity", "identity"), ("fp16", "fp16")):
        model = build_hsdp(mesh, False)
        state = gcomp.install(model, "identity")
        replica = gcomp.fsdp.replicate(state, mesh["replicate"].get_group(), across)
        opt = train(model, STEPS - 1)
        before = replica.stats["bytes_sent"]
        train(model, 1, start=STEPS - 1, opt=opt)
        shard_bytes = sum(-(-s[0] // 2) * (s[1] if len(s) > 1 else 1) for p in model.parameters()
                          for s in [p.size()]) * (2 if across == "fp16" else 4)
        out[label] = {"params": full_params(model), "last": replica.stats["bytes_sent"] - before,
                      "expected": shard_bytes, "steps": replica.stats["steps"]}
    return out

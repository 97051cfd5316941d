"""``dgc``: Deep Gradient Compression (Lin, Han, Mao, Wang, Dally, ICLR 2018).

Momentum correction, local gradient clipping, momentum-factor masking, a warm-up schedule of the density and
a sampled threshold estimate, all vectorised. The momentum lives here: train with plain SGD (momentum 0).
"""
from __future__ import annotations

import math
from typing import Annotated

import torch
import torch.distributed as dist

from gcomp.bucket import BucketInfo
from gcomp.bucket_state import BucketState
from gcomp.collectives import AllgatherCommunicator
from gcomp.collectives.narrow_values import narrow
from gcomp.compressors.device_random import DeviceStream
from gcomp.compressors.quantise import stream_seed
from gcomp.compressors.sparse import PositionsParam, SparseCompressor, ValuesParam
from gcomp.core import check_state, sum_by_name
from gcomp.state_checks import generator_state
from gcomp.kernels import on_device, segments
from gcomp.memory import NoMemory
from gcomp.method import Method
from gcomp.params import Range
from gcomp.registry import register

_BUFFERS = ("momentum", "velocity")
_SAMPLES_PER_SELECTED = 8  # at least 8 / density samples: the threshold's rank among them is >= 16
_TARGET, _CAP = 2, 4       # the sampled threshold aims at 2k candidates and keeps at most 4k


class DGCCompressor(SparseCompressor):
    """Sends a fixed ``k = ceil(density * n)`` entries of the momentum-corrected velocity per bucket, by
    all-gather; the same k on every rank, so no sizes are exchanged. Entries several ranks chose are summed.
    k values (``values``: the bucket's dtype, bf16/fp16, or fp8_e4m3 with one fp32 scale; the rounding stays
    in the velocity) and k positions, coded by default (``gcomp.collectives.coded_positions``: the smaller of a
    bitmap, n bits, and Elias-Fano, k L + k + ceil(n / 2**L) bits with L = max(0, floor(log2(n / k))));
    ``positions=raw``: int32 (int64 past 2**31 elements).

    Per bucket and step: clip each parameter's local gradient to ``clip_norm / sqrt(world)`` (if set); momentum
    correction ``u = m u + g; v = v + u`` (Nesterov: ``u = m (u + g); v = v + u + g``); select on |v|;
    momentum-factor masking ``u[sent] = 0`` and ``v[sent] = 0``. Where the bucket holds more than twice the
    sample (``max(n * sample_ratio, 8 n / k)`` entries, so about 16 / density at least) the selection thresholds |v| at a value estimated from a strided sample (aiming at 2k nonzero candidates), keeps at most 4k
    candidates and takes the top k among them exactly, which is the exact top k whenever between k and 4k
    pass; if fewer pass (rare, or a mostly-zero bucket), the empty slots carry a zero value at position 0.

    On the device path (``gcomp.kernels.on_device``) the sample's offset is drawn on the bucket's device, from
    ``device_stream`` (seeded per rank like the CPU's generator; in the checkpoint once it has drawn), so the
    sample differs from the CPU's; the clipping norms are segment sums (``gcomp.kernels.segments``). The rest is
    the same code, bucket-wide and without a host synchronisation on either path.
    """

    stateful = True
    holds_gradient = True  # the velocity: what was accumulated and not sent yet
    distinct_positions = False  # empty slots repeat position 0

    def __init__(self, ratio: float, momentum: float, nesterov: bool, masking: bool, clip_norm: float,
                 warmup_steps: int, warmup_stages: int, sample_ratio: float, seed: int, positions: str = "raw",
                 values: str = "fp32"):
        self.wire(positions, values)
        self.ratio, self.momentum, self.nesterov, self.masking = ratio, momentum, nesterov, masking
        self.clip_norm, self.sample_ratio, self.seed = clip_norm, sample_ratio, seed
        self.warmup_steps, self.warmup_stages = warmup_steps, warmup_stages
        self.world_size, self.rank = 1, 0
        self.steps = 0  # compressing steps begun (counted at bucket 0)
        self.generator = torch.Generator().manual_seed(stream_seed(seed, "dgc", 0))
        self.device_stream = DeviceStream(seed, "dgc", 0)
        # one scratch entry past each buffer's end, always zero: the selection's empty slots point there, so
        # clearing the sent entries never touches an entry that was not sent
        self.state = BucketState(_BUFFERS, spare=1, owner="DGCCompressor")
        self._segment_ids: dict[str, torch.Tensor] = {}

    def bind(self, model, group, stats) -> None:
        if dist.is_available() and dist.is_initialized():
            self.world_size, self.rank = dist.get_world_size(group), dist.get_rank(group)
        self.generator.manual_seed(stream_seed(self.seed, "dgc", self.rank))  # independent samples per rank
        self.device_stream = DeviceStream(self.seed, "dgc", self.rank)

    def density(self, step: int) -> float:
        """Warm-up: ``warmup_stages`` equal stages over ``warmup_steps``, density ``c ** (stage + 1)`` with
        ``c = ratio ** (1 / (stages + 1))`` (the paper's 25%, 6.25%, 1.56%, 0.39% for 0.1% and 4 stages)."""
        if step >= self.warmup_steps:
            return self.ratio
        stage = step * self.warmup_stages // self.warmup_steps
        return max(self.ratio ** ((stage + 1) / (self.warmup_stages + 1)), self.ratio)

    def compress(self, tensor, bucket):
        if bucket.index == 0:
            self.steps += 1
        n = tensor.numel()
        # the slack keeps float noise from adding an entry (3000 * 0.01 is 30.000000000000004)
        k = max(1, min(n, math.ceil(n * self.density(max(self.steps - 1, 0)) - 1e-6)))
        grad = self._clip(tensor, bucket) if self.clip_norm > 0 else tensor
        buffers = self.state.get(bucket, tensor)
        u_ext, v_ext = buffers["momentum"], buffers["velocity"]
        u, v = u_ext[:n], v_ext[:n]
        if self.nesterov:
            u.add_(grad).mul_(self.momentum)
            v.add_(u).add_(grad)
        else:
            u.mul_(self.momentum).add_(grad)
            v.add_(u)
        index = self._select(v, k)  # n for an empty slot: the scratch entry, zero
        values = v_ext[index]
        if self.values == "fp32":
            v_ext.index_fill_(0, index, 0)
        else:  # what rounding takes off stays in the velocity (the empty slots' scratch entry: 0 - 0)
            v_ext.index_put_((index,), values - narrow(values, self.values)[2])
        if self.masking:
            u_ext.index_fill_(0, index, 0)
        for t in (u, v):  # a non-finite entry left behind would poison every later step
            torch.nan_to_num_(t, nan=0.0, posinf=0.0, neginf=0.0)
        index = torch.where(index < n, index, 0)  # an empty slot adds a zero at position 0
        return self.sparse_payload(values, index, tensor, bucket)

    def flush(self, bucket, like):
        """The velocity of ``bucket`` (accumulated, not sent), handed back; velocity and momentum start over."""
        buffers = self.state.find(bucket, like)
        if buffers is None:
            return None
        velocity = buffers["velocity"][:like.numel()].clone()
        for name in _BUFFERS:
            buffers[name].zero_()
        return velocity

    def _clip(self, tensor: torch.Tensor, bucket: BucketInfo) -> torch.Tensor:
        """Each parameter's local gradient (``world * tensor``) clipped to norm ``clip_norm / sqrt(world)``."""
        wide = torch.float64 if tensor.dtype == torch.float64 else torch.float32
        limit = self.clip_norm / self.world_size ** 1.5  # on the bucket's g / world
        if on_device(tensor):  # segment sums: no index as large as the bucket, no parameter count read
            lengths = tuple(bucket.numels)
            factor = (limit / segments.reduce(tensor.to(wide).square(), lengths, "sum").sqrt_()).clamp_(max=1.0)
            return tensor * segments.expand(factor.to(tensor.dtype), lengths, tensor.numel())
        ids = self._segment_ids.get(bucket.key)
        if ids is None or ids.device != tensor.device:
            ids = torch.repeat_interleave(torch.arange(len(bucket.numels), device=tensor.device),
                                          torch.tensor(bucket.numels, device=tensor.device))
            self._segment_ids[bucket.key] = ids
        squares = torch.zeros(len(bucket.numels), dtype=wide, device=tensor.device)
        squares.index_add_(0, ids, tensor.to(squares.dtype).square())
        factor = (limit / squares.sqrt()).clamp_(max=1.0)  # a zero norm gives inf, clamped to 1
        return tensor * factor[ids].to(tensor.dtype)

    def _select(self, v: torch.Tensor, k: int) -> torch.Tensor:
        """``k`` positions (int64) of large |v|; ``n`` marks an empty slot (fewer than k candidates)."""
        n = v.numel()
        scores = torch.nan_to_num(v.abs(), nan=float("inf"))  # NaN ranks above every finite magnitude
        wanted = max(math.ceil(n * self.sample_ratio), math.ceil(_SAMPLES_PER_SELECTED * n / k))
        if 2 * wanted >= n:
            return torch.topk(scores, k, sorted=False).indices
        stride = n // wanted
        m = n // stride
        if on_device(v):
            start = torch.randint(0, stride, (1,), generator=self.device_stream.next(v.device), device=v.device)
        else:
            start = torch.randint(0, stride, (1,), generator=self.generator).to(v.device, non_blocking=True)
        samples = scores[start + torch.arange(m, device=v.device) * stride]
        rank = min(m, math.ceil(_TARGET * m * k / n))
        threshold = torch.topk(samples, rank, sorted=False).values.min()
        width = min(n, _CAP * k)
        # zeros are never candidates: sending one changes nothing, and a mostly-zero bucket would otherwise
        # fill the candidate list with the first zeros in index order
        passing = (scores >= threshold).logical_and_(scores > 0)
        candidates = torch.nonzero_static(passing, size=width, fill_value=n).squeeze(1)
        ranked = torch.where(candidates < n, scores[candidates.clamp(max=n - 1)], -1)
        return candidates[torch.topk(ranked, k, sorted=False).indices]


    def state_dict(self) -> dict:
        # the device stream only once it drew: the CPU path's checkpoint stays as it was
        device = {"device_stream": self.device_stream.state_dict()} if self.device_stream.draws else {}
        return {"generator": self.generator.get_state(), "steps": self.steps, **device, **self.state.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        check_state(self, state, {"generator": torch.Tensor, "steps": int, **{b: dict for b in _BUFFERS}},
                    {"device_stream": dict})
        if state["steps"] < 0:
            raise ValueError(f"DGCCompressor: 'steps' must be at least 0, got {state['steps']}")
        generator_state("dgc", "cpu", state["generator"])  # checked before anything is loaded
        if "device_stream" in state:
            self.device_stream.load_state_dict(state["device_stream"])
        else:  # a checkpoint of the CPU path, or after a resize: a fresh stream of this rank's
            self.device_stream = DeviceStream(self.seed, "dgc", self.rank)
        self.generator.set_state(state["generator"])
        self.steps = state["steps"]
        self.state.load_state_dict({b: state[b] for b in _BUFFERS})  # checks each buffer's tensors

    def parameter_state(self, state: dict) -> dict:
        return {b: state[b] for b in _BUFFERS}

    def merge_states(self, assigned: list[dict], every: list[dict], rank: int) -> dict:
        """Momentum and velocity are linear in the gradients: their sums over ranks, which the next steps
        depend on, are kept; the new rank's sample offsets start its own stream."""
        fresh = torch.Generator().manual_seed(stream_seed(self.seed, "dgc", rank))
        return {"generator": fresh.get_state(), "steps": every[0]["steps"],
                **{b: sum_by_name([s[b] for s in assigned]) for b in _BUFFERS}}


@register("dgc", paper="Lin, Han, Mao, Wang, Dally, ICLR 2018 (Deep Gradient Compression)")
def dgc(
    ratio: Annotated[float, Range(0, 1, low_open=True), "density after warm-up: fraction of each bucket sent"] = 0.001,
    momentum: Annotated[float, Range(0, 1, high_open=True), "momentum of the correction (use SGD without momentum)"]
    = 0.9,
    nesterov: Annotated[bool, "Nesterov momentum correction"] = False,
    masking: Annotated[bool, "momentum-factor masking: clear the momentum of sent entries"] = True,
    clip_norm: Annotated[float, Range(0, None), "local clipping: max norm per parameter of the summed gradient, "
                                                "each rank clips at clip_norm / sqrt(world) (0: off)"] = 0.0,
    warmup_steps: Annotated[int, Range(0, None), "compressing steps of density warm-up (0: none)"] = 0,
    warmup_stages: Annotated[int, Range(1, None), "warm-up stages, density falling exponentially to ratio"] = 4,
    sample_ratio: Annotated[float, Range(0, 1, low_open=True), "fraction of |v| sampled for the threshold"] = 0.01,
    seed: Annotated[int, Range(0, None), "seed of the sample offsets (each rank draws its own stream from it)"] = 0,
    positions: PositionsParam = "coded",
    values: ValuesParam = "fp32",
) -> Method:
    """Deep Gradient Compression: momentum-corrected top-k by sampled threshold, masking, warm-up, all-gather."""
    return Method(DGCCompressor(ratio, momentum, nesterov, masking, clip_norm, warmup_steps, warmup_stages,
                                sample_ratio, seed, positions, values), NoMemory(), AllgatherCommunicator())

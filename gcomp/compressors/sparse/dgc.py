"""``dgc``: Deep Gradient Compression (Lin, Han, Mao, Wang, Dally, ICLR 2018): momentum correction, local gradient
clipping, momentum-factor masking, a warm-up schedule of the density and a sampled threshold estimate. The momentum
lives here: train with plain SGD (momentum 0)."""
from __future__ import annotations

import math

import torch
import torch.distributed as dist

from gcomp.bucket import expand, segment_reduce
from gcomp.compressors.sparse.topk import SparseCompressor, SparseCtx
from gcomp.core import ALLGATHER, Keeps, Payload, Traits, contraction
from gcomp.randomness import Stream
from gcomp.state_checks import check_state

_SAMPLES_PER_SELECTED = 8  # at least 8 / density samples: the threshold's rank among them is >= 16
_TARGET, _CAP = 2, 4       # the sampled threshold aims at 2k candidates and keeps at most 4k


class DGCCompressor(SparseCompressor):
    """Sends a fixed ``k = ceil(density * n)`` entries of the momentum-corrected velocity per bucket, by all-gather
    (the same k on every rank: no sizes exchanged); entries several ranks chose are summed. k values (``values``: the
    bucket's dtype, bf16/fp16, or fp8_e4m3 with one fp32 scale; the rounding stays in the velocity) and k positions,
    coded (the smaller of a bitmap and Elias-Fano) or raw (int32, int64 past 2**31 entries).

    Per bucket and step: clip each parameter's local gradient to ``clip_norm / sqrt(world)`` (if set); momentum
    correction ``u = m u + g; v = v + u`` (Nesterov: ``u = m (u + g); v = v + u + g``); select on |v|; momentum-factor
    masking ``u[sent] = 0`` and ``v[sent] = 0``. ``u`` and ``v`` are the method's slots (``momentum``, ``velocity``:
    what was accumulated and not sent). Where the bucket holds more than twice the sample (``max(n * sample_ratio,
    8 n / k)`` entries) the selection thresholds |v| at a value estimated from a strided sample (its offset drawn per
    rank from ``stream``), aiming at 2k nonzero candidates, keeps at most 4k and takes the top k among them exactly:
    the exact top k whenever between k and 4k pass. If fewer pass, the empty slots carry a zero value (at the last
    position). Bucket-wide, no host synchronisation."""

    def __init__(self, ratio: float, momentum: float, nesterov: bool, masking: bool, clip_norm: float,
                 warmup_steps: int, warmup_stages: int, sample_ratio: float, seed: int, positions: str = "raw",
                 values: str = "fp32"):
        super().__init__(positions, values)
        self.ratio, self.momentum, self.nesterov, self.masking = ratio, momentum, nesterov, masking
        self.clip_norm, self.sample_ratio, self.seed = clip_norm, sample_ratio, seed
        self.warmup_steps, self.warmup_stages = warmup_steps, warmup_stages
        self.world_size, self.steps = 1, 0  # compressing steps begun (counted at bucket 0)
        self.stream = Stream(seed, "dgc", 0)
        wire = self.wire
        fixed = None if warmup_steps else lambda bucket, world: wire.nbytes(bucket.numel, self.count(bucket.numel, 0),
                                                                             bucket.dtype)
        self.traits = Traits(ALLGATHER, contraction(0), Keeps.RANK, slots=("momentum", "velocity"),
                             held=("velocity",), rows=None, wire_bytes=fixed)

    def bind(self, model, group, stats) -> None:
        if dist.is_available() and dist.is_initialized():
            self.world_size = dist.get_world_size(group)
            self.stream.bind(dist.get_rank(group))  # independent samples per rank

    def density(self, step: int) -> float:
        """Warm-up: ``warmup_stages`` equal stages over ``warmup_steps``, density ``c ** (stage + 1)`` with
        ``c = ratio ** (1 / (stages + 1))`` (the paper's 25%, 6.25%, 1.56%, 0.39% for 0.1% and 4 stages)."""
        if step >= self.warmup_steps:
            return self.ratio
        stage = step * self.warmup_stages // self.warmup_steps
        return max(self.ratio ** ((stage + 1) / (self.warmup_stages + 1)), self.ratio)

    def count(self, n: int, step: int) -> int:
        # the slack keeps float noise from adding an entry (3000 * 0.01 is 30.000000000000004)
        return max(1, min(n, math.ceil(n * self.density(step) - 1e-6)))

    def encode(self, x, state, layout):
        if layout.index == 0:
            self.steps += 1
        flat = x.reshape(-1)
        n = flat.numel()
        grad = self._clip(flat, layout.numels) if self.clip_norm > 0 else flat
        u, v = state["momentum"], state["velocity"]
        if self.nesterov:
            u.add_(grad).mul_(self.momentum)
            v.add_(u).add_(grad)
        else:
            u.mul_(self.momentum).add_(grad)
            v.add_(u)
        index, real = self._select(v, self.count(n, max(self.steps - 1, 0)))
        tensors, order, _, sent = self.wire.encode(index[None], torch.where(real, v[index], 0)[None], n)
        v.index_add_(0, order.view(-1), sent.view(-1), alpha=-1)  # what rounding took off stays; padding adds 0
        if self.masking:  # the padding multiplies by 1
            u.scatter_reduce_(0, index, real.logical_not().to(u.dtype), "prod")
        for t in (u, v):  # a non-finite entry left behind would poison every later step
            torch.nan_to_num_(t, nan=0.0, posinf=0.0, neginf=0.0)
        return Payload(tensors, SparseCtx(n, x.dtype, index.numel())), state

    def _clip(self, flat: torch.Tensor, lengths: tuple[int, ...]) -> torch.Tensor:
        """Each parameter's local gradient (``world * flat``) clipped to norm ``clip_norm / sqrt(world)``."""
        wide = torch.float64 if flat.dtype == torch.float64 else torch.float32
        limit = self.clip_norm / self.world_size ** 1.5  # on the bucket's g / world
        factor = (limit / segment_reduce(flat.to(wide).square(), lengths, "sum").sqrt_()).clamp_(max=1.0)
        return flat * expand(factor.to(flat.dtype), lengths, flat.numel())  # a zero norm: inf, clamped to 1

    def _select(self, v: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``k`` positions (int64) of large |v| and which are real: fewer than k candidates leave padding slots."""
        n = v.numel()
        scores = torch.nan_to_num(v.abs(), nan=float("inf"))  # NaN ranks above every finite magnitude
        wanted = max(math.ceil(n * self.sample_ratio), math.ceil(_SAMPLES_PER_SELECTED * n / k))
        if 2 * wanted >= n:
            top = torch.topk(scores, k, sorted=False)
            return top.indices, top.values >= 0
        stride = n // wanted
        m = n // stride
        start = torch.randint(0, stride, (1,), generator=self.stream.next(v.device), device=v.device)
        samples = scores[start + torch.arange(m, device=v.device) * stride]
        threshold = torch.topk(samples, min(m, math.ceil(_TARGET * m * k / n)), sorted=False).values.min()
        # zeros are never candidates: sending one changes nothing, and a mostly-zero bucket would otherwise fill
        # the candidates with the first zeros in index order
        passing = (scores >= threshold).logical_and_(scores > 0)
        candidates = torch.nonzero_static(passing, size=min(n, _CAP * k), fill_value=n).squeeze(1)
        top = torch.topk(torch.where(candidates < n, scores[candidates.clamp(max=n - 1)], -1), k, sorted=False)
        return candidates[top.indices].clamp_(max=n - 1), top.values >= 0

    def state_dict(self) -> dict:
        return {"generator": self.stream.state_dict(), "steps": self.steps}

    def load_state_dict(self, state: dict) -> None:
        """Also gcomp 0.1's: ``generator`` a CPU generator's state and ``device_stream`` the stream's (if drawn)."""
        check_state(self, state, {"generator": (torch.Tensor, dict), "steps": int}, {"device_stream": dict})
        if state["steps"] < 0:
            raise ValueError(f"DGCCompressor: 'steps' must be at least 0, got {state['steps']}")
        self.stream.load_state_dict(state.get("device_stream", state["generator"]))
        self.steps = state["steps"]

    def merge_states(self, assigned: list[dict], every: list[dict], rank: int) -> dict:
        """The slots are summed by the method; the new rank's sample offsets start a stream of its own."""
        return {"generator": {"seed": self.seed, "draws": 0}, "steps": every[0]["steps"]}

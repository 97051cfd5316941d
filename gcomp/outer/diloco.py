"""``DiLoCo``: the outer loop as a gcomp state (docs/outer.md), and ``keep_local`` for a trainer's DDP model."""
from __future__ import annotations

from typing import Callable, Union

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from gcomp.agreement import agree, global_ranks
from gcomp.collectives.launch import launched
from gcomp.method import MethodUnit
from gcomp.outer import arguments, saved
from gcomp.outer.fragments import Pending, buckets, due, split
from gcomp.outer.identical import check_identical
from gcomp.run_state import FIXES, RunState

STAT_KEYS = ("inner_steps", "outer_steps")
OUTER_FIXES = {**FIXES, "outer": "Make gcomp.outer.DiLoCo with the same sync_every, fragments, overlap, bucket_mb, "
                                 "alpha and check_every on every rank",
               "outer optimizer": "Build the same outer optimizer on every rank",
               "inner group": "Pass the same inner_group (the same ranks) on every rank of a node"}


class DiLoCo(RunState):
    """DiLoCo (Douillard et al., 2023) and Streaming DiLoCo (Douillard et al., 2025) with any gcomp method on the
    outer gradient; call ``step()`` after each inner optimizer step (docs/outer.md: arguments, statistics).

    On the wire: what the method sends for each flat bucket of the outer gradient ``(θ_global − θ_local) / P``,
    once per fragment every ``sync_every`` steps, over ``group`` with the method's collective; per outer step, one
    all-gather of an int64 digest per bucket (``check_every``); at construction, the agreement's all-gather and a
    broadcast of rank 0's parameters.
    """

    kind = "diloco"

    def __init__(self, model: torch.nn.Module, sync_every: int = 50, method: Union[str, MethodUnit] = "identity",
                 outer_optimizer: Callable | None = None, group: dist.ProcessGroup | None = None,
                 inner_group: dist.ProcessGroup | None = None, fragments: int = 1, overlap: int = 0,
                 bucket_mb: float = 25, alpha: float = 1.0, check_every: int = 1):
        arguments.check(sync_every, fragments, overlap, bucket_mb, alpha, check_every)
        unit = arguments.outer_method(method)
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"gcomp.outer.DiLoCo takes a torch.nn.Module; got {type(model).__name__}")
        super().__init__(unit, group, STAT_KEYS)
        self.model = model.module if isinstance(model, DistributedDataParallel) else model
        trained = [(n, p) for n, p in self.model.named_parameters() if p.requires_grad]
        if not trained:
            raise ValueError("gcomp.outer.DiLoCo: the model has no parameter that requires grad")
        self.names = [n for n, _ in trained]
        self.params = [p for _, p in trained]
        self.sync_every, self.fragments, self.overlap = sync_every, fragments, overlap
        self.bucket_mb, self.alpha, self.check_every = bucket_mb, float(alpha), check_every
        self.inner_group = inner_group
        self._numels = {n: p.numel() for n, p in trained}
        self.layout = []  # per fragment, its buckets
        for members in split([p.numel() for p in self.params], fragments):
            self.layout.append(buckets(self.names, self.params, members, sum(map(len, self.layout)), bucket_mb))
        with torch.no_grad():
            self.theta = [self._local(b).clone().requires_grad_(True) for f in self.layout for b in f]
        self.outer_optimizer = arguments.outer_optimizer_of(outer_optimizer, self.theta)
        self._pending: Pending | None = None
        self._loaded: dict | None = None
        self._syncs = 0  # fragment syncs applied (for check_every)
        if not dist.is_initialized():
            raise RuntimeError("gcomp.outer.DiLoCo needs torch.distributed's process group: init_process_group "
                               "first")
        self.join(self.model)
        if inner_group is not None:  # the node's ranks: alike but for the cross-node group each is in
            fields = self.agreement_fields(self.model)
            fields["process group"] = f"{self.world_size} ranks"
            agree("gcomp (DiLoCo, inner group)", fields, inner_group, OUTER_FIXES)
        self._start_alike()

    # --- construction ---------------------------------------------------------------------------------------

    def agreement_fields(self, model) -> dict[str, str]:
        fields = super().agreement_fields(None)
        fields["parameters"] = "\n".join(f"{n} {tuple(p.shape)} {p.dtype}" for n, p in zip(self.names, self.params))
        fields["outer"] = (f"sync_every={self.sync_every} fragments={self.fragments} overlap={self.overlap} "
                           f"bucket_mb={self.bucket_mb} alpha={self.alpha} check_every={self.check_every}")
        fields["outer optimizer"] = arguments.describe_optimizer(self.outer_optimizer)
        fields["inner group"] = ("none" if self.inner_group is None else
                                 f"{dist.get_world_size(self.inner_group)} ranks")
        return fields

    def _start_alike(self) -> None:
        """Every rank starts from rank 0's parameters (as DDP does at construction): the global copy is broadcast
        from the group's first rank and the model takes it."""
        if self.world_size > 1:
            src = global_ranks(self.group)[0]
            for theta in self.theta:
                dist.broadcast(theta.data, src=src, group=self.group)
        for f in range(self.fragments):
            self._write(f, self.theta_of(f))

    # --- flat views ---------------------------------------------------------------------------------------

    def _local(self, bucket) -> torch.Tensor:
        """The model's parameters of ``bucket``, flat, in the bucket's dtype (a new tensor)."""
        flat = torch.cat([self.params[i].detach().reshape(-1) for i in bucket.params])
        return flat.to(bucket.info.dtype)

    def theta_of(self, fragment: int) -> list[torch.Tensor]:
        """The global copy's flat buckets of ``fragment``."""
        return [self.theta[b.info.index] for b in self.layout[fragment]]

    def _write(self, fragment: int, flats: list[torch.Tensor]) -> None:
        """Each parameter of ``fragment`` takes its slice of ``flats`` (rounded to the parameter's dtype)."""
        with torch.no_grad():
            for b, flat in zip(self.layout[fragment], flats):
                for i, piece in zip(b.params, flat.detach().split(b.info.numels)):
                    self.params[i].copy_(piece.view_as(self.params[i]))

    # --- the loop -------------------------------------------------------------------------------------------

    def step(self) -> bool:
        """Count one inner step; apply the fragment whose reduction is due, launch those whose turn it is. True
        when a fragment's reduction was launched or applied in this call."""
        self.count_step()
        s = self.stats["inner_steps"] = self.iteration
        acted = self._pending is not None and self._pending.apply_at <= s
        if acted:
            self.synchronize()
        for f in due(s, self.fragments, self.sync_every):
            pending = Pending(f, s + self.overlap, future=self._launch(f))
            if self.overlap:
                self._pending = pending
            else:
                self._apply(f, pending.result())
            acted = True
        return acted

    def _launch(self, fragment: int) -> torch.futures.Future:
        """The outer gradient of ``fragment``, bucket by bucket, divided by the group's size and handed to the
        method; a future of the list of the buckets' futures."""
        launched = []
        for b in self.layout[fragment]:
            delta = self.theta[b.info.index].detach() - self._local(b)
            delta.div_(self.world_size)
            self.stats["buckets"] += 1
            self.stats["bytes_dense"] += delta.numel() * delta.element_size()
            launched.append(self.method.reduce(delta, b.info, self.group, self.stats))
        return torch.futures.collect_all(launched)

    def _apply(self, fragment: int, means: list[torch.Tensor]) -> None:
        """The outer optimizer's step on ``fragment`` with the reduced outer gradient ``means``, the check, and
        the merge into the model."""
        thetas = self.theta_of(fragment)
        for theta, mean in zip(thetas, means):
            theta.grad = mean.reshape(-1).to(theta.dtype)
        self.outer_optimizer.step()
        for theta in thetas:
            theta.grad = None
        self._syncs += 1
        self.stats["outer_steps"] += 1
        if self.check_every and self._syncs % self.check_every == 0:
            infos = [b.info for b in self.layout[fragment]]
            check_identical("gcomp.outer.DiLoCo", thetas, infos, self.group)
            if self.inner_group is not None:
                check_identical("gcomp.outer.DiLoCo (inner group)", thetas, infos, self.inner_group)
        if self.alpha == 1.0:
            self._write(fragment, thetas)
        else:
            with torch.no_grad():
                merged = [torch.lerp(self._local(b), theta.detach(), self.alpha)
                          for b, theta in zip(self.layout[fragment], thetas)]
            self._write(fragment, merged)

    def synchronize(self) -> None:
        """Apply the reduction in flight now, if any (before evaluating or saving the model mid-overlap)."""
        if self._pending is not None:
            pending, self._pending = self._pending, None
            self._apply(pending.fragment, pending.result())

    # --- checkpoints: RunState's, plus the outer part (gcomp.outer.saved) ---------------------------------

    def state_dict(self) -> dict:
        """``RunState.state_dict`` and ``"outer"`` (``gcomp.outer.saved``), the part every rank shares."""
        state = super().state_dict()
        state["outer"] = saved.outer_state(self)
        return state

    def load_state_dict(self, state: dict) -> None:
        """``RunState.load_state_dict``, then the outer part, checked inside the same agreement."""
        if not isinstance(state, dict) or "outer" not in state:
            self._loaded = None
            inner = state
        else:
            self._loaded = state["outer"]
            inner = {k: v for k, v in state.items() if k != "outer"}
        super().load_state_dict(inner)
        saved.load_outer(self, self._loaded)
        self._loaded = None

    def _check_parameters(self, part: dict) -> None:
        super()._check_parameters(part)
        saved.check_outer(self, self._loaded)


def local_hook(inner_group, bucket):
    """A trainer's DDP hook under DiLoCo: each bucket (a ``dist.GradBucket``) averaged over ``inner_group`` (None:
    left as it is). (No annotations: DDP compares them with ``GradBucket`` and ``Future[Tensor]``, and this module's
    are postponed strings, which it refuses.)"""
    buffer = bucket.buffer()
    if inner_group is None:
        done = torch.futures.Future()
        done.set_result(buffer)
        return done
    buffer.div_(dist.get_world_size(inner_group))
    return launched(dist.all_reduce(buffer, group=inner_group, async_op=True)).then(lambda fut: fut.value()[0])


def keep_local(ddp: torch.nn.Module, inner_group=None) -> None:
    """Register ``local_hook`` on a trainer's DDP model (before its first step): its inner steps stay local, or
    within ``inner_group``, instead of all-reducing each inner step's gradient across nodes."""
    if not isinstance(ddp, DistributedDataParallel):
        raise TypeError(f"gcomp.outer.keep_local takes a DistributedDataParallel model; got {type(ddp).__name__}")
    if getattr(ddp, "_gcomp_state", None) is not None:
        raise RuntimeError("a gcomp hook is already installed on this DDP model: under DiLoCo the inner steps stay "
                           "local (or within inner_group), and the outer loop is where the method sits")
    ddp.register_comm_hook(inner_group, local_hook)
    ddp._gcomp_state = "gcomp.outer local steps"

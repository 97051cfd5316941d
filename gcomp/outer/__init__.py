"""The outer loop as another place a method sits: DiLoCo and Streaming DiLoCo with any gcomp method on the outer
gradient (``docs/outer.md``).

    outer = gcomp.outer.DiLoCo(model, sync_every=50, method="topk:ratio=0.05")
    for x, y in data:
        loss_fn(model(x), y).backward(); inner_opt.step(); inner_opt.zero_grad()
        outer.step()
"""
from gcomp.outer.arguments import default_outer_optimizer
from gcomp.outer.diloco import DiLoCo, keep_local
from gcomp.outer.fragments import due, offset, split

__all__ = ["DiLoCo", "default_outer_optimizer", "due", "keep_local", "offset", "split"]

"""Registered methods, each with one change that breaks its error model (``traits.fidelity``) while keeping it
consistent (every rank decodes the same thing, alike, from what was sent), for tests/test_testing_kit.py: module
level, so that ``gcomp.testing.check_method``'s worker processes import them."""
from __future__ import annotations

import functools
import types

import torch

import gcomp


def _changed(name: str, member: str, change) -> gcomp.Method:
    """``gcomp.create(name)`` with its compressor's ``member`` replaced by ``change(original, self, *args)``."""
    method = gcomp.create(name)
    original = getattr(type(method.compressor), member)
    setattr(method.compressor, member, types.MethodType(functools.partial(change, original), method.compressor))
    return method


def _zero_first(decode, self, received, ctx):
    out = decode(self, received, ctx).clone()
    out[0] = 0
    return out


def _smallest(encode, self, x, state, layout):
    from gcomp.compressors.sparse.topk import top_count
    flat = x.reshape(-1)
    index = torch.topk(flat.abs(), top_count(flat.numel(), self.ratio), largest=False).indices
    return self.payload(flat, index, flat[index]), state


def _doubled(decode, self, received, ctx):
    return decode(self, received, ctx) * 2


def fp16_zeroing_first() -> gcomp.Method:
    """fp16 whose decode zeroes the first entry of every bucket."""
    return _changed("fp16", "decode", _zero_first)


def topk_smallest() -> gcomp.Method:
    """topk that keeps the k smallest entries instead of the largest."""
    return _changed("topk", "encode", _smallest)


def qsgd_doubled() -> gcomp.Method:
    """qsgd whose decode doubles the scale."""
    return _changed("qsgd", "decode", _doubled)

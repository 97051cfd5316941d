"""PowerSGD's layout of one bucket (``_Plan``: which parameters travel dense, which as P and Q, and where), one
payload's local context (``_Ctx``) and the orthogonalisation every rank applies alike to the summed P.

``gcomp.compressors.powersgd`` runs the plan parameter by parameter (its CPU path);
``gcomp.compressors.powersgd_batched`` runs it on stacks of same-shape matrices (its device path).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

ORTHOGONALISATION_EPS = 1e-8


def orthogonalise(matrix: torch.Tensor, eps: float = ORTHOGONALISATION_EPS) -> torch.Tensor:
    """Orthonormal columns spanning those of an (n, r) matrix, written in place; deterministic, so every rank
    turns the same summed P into the same P^.

    Rank 1: a normalisation (``eps`` keeps a zero column at zero). Rank > 1: Householder QR, which stays
    orthonormal when P is rank-deficient (a gradient of lower rank than r, or r >= min(n, m)); Gram-Schmidt
    would normalise rounding noise into columns that are not orthogonal, and P^ P^T M would no longer be a
    projection (PyTorch's hook uses Gram-Schmidt up to rank 2).
    """
    if matrix.shape[1] == 1:
        return matrix.div_(torch.linalg.vector_norm(matrix) + eps)
    return matrix.copy_(torch.linalg.qr(matrix).Q)


@dataclass(frozen=True)
class _Matrix:
    name: str
    offset: int  # in the bucket
    n: int
    m: int
    r: int
    p_offset: int  # in the first round's buffer (after the dense entries)
    q_offset: int  # in the Q buffer


@dataclass(frozen=True)
class _Plan:
    """How one bucket layout is sent: dense segments first, then every compressed matrix's P."""

    dense: tuple[tuple[int, int], ...]  # (offset in the bucket, numel)
    dense_numel: int
    matrices: tuple[_Matrix, ...]
    p_numel: int
    q_numel: int


@dataclass
class _Ctx:
    plan: _Plan
    numel: int
    dtype: torch.dtype
    compensated: list = field(default_factory=list)  # M (+ error) per matrix, in the compute dtype
    exchanged: bool = False  # True once the P sum is orthogonalised in place and Q holds M^T P^
    # the device path's stacks of same-shape matrices (``powersgd_batched.Stacks``); ``compensated`` then holds one
    # (B, n, m) stack of M per group
    batched: Any = None

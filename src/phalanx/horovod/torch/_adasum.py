"""Adasum (Maleki et al., 2020): ``hvd.allreduce(x, op=hvd.Adasum)``.

Two ranks' vectors ``a`` and ``b`` combine as

    a' = (1 - a·b / (2 |a|²)) a + (1 - a·b / (2 |b|²)) b

(a zero vector's coefficient is 1), and ``n = 2^k`` ranks combine in the order of
recursive vector halving with distance doubling: ranks ``2i`` and ``2i+1`` first,
then those pairs' results pairwise, and so on (``((v0 ⊕ v1) ⊕ (v2 ⊕ v3)) ⊕ ...``).
Each tensor is combined on its own (a grouped call combines tensor by tensor).

How: the ranks' tensors are gathered with one phalanx allgather and every rank
combines them in that tree order, in float64 (dot products and norms too), so
every rank computes the same result; it equals the halving-doubling exchange's up
to rounding, and costs ``size()`` times the tensor in memory and traffic (phalanx
has no point-to-point messages to halve the vectors with). As in Horovod, a number
of ranks that is not a power of two raises HorovodUnsupportedError (Horovod:
"Running Adasum with non-power of 2 ranks is not supported yet"); unlike Horovod,
process sets (of a power-of-two size) are accepted.
"""

from __future__ import annotations

from typing import Any

import phalanx

from .._errors import HorovodUnsupportedError

__all__: list[str] = []


def combine_pair(a: Any, b: Any) -> Any:
    """Adasum of two float64 vectors: ``(1 - a·b/2|a|²) a + (1 - a·b/2|b|²) b``."""
    dot = float(a @ b)
    aa, bb = float(a @ a), float(b @ b)
    ca = 1.0 - dot / (2.0 * aa) if aa > 0.0 else 1.0
    cb = 1.0 - dot / (2.0 * bb) if bb > 0.0 else 1.0
    return ca * a + cb * b


def combine(vectors: list[Any]) -> Any:
    """Adasum of ``2^k`` vectors in the recursive-halving tree order (rank pairs at distance 1, 2, 4...)."""
    while len(vectors) > 1:
        vectors = [combine_pair(vectors[i], vectors[i + 1]) for i in range(0, len(vectors), 2)]
    return vectors[0]


def adasum_allreduce(out: Any, n: int, group: Any) -> Any:
    """Replace tensor ``out`` by the Adasum of every rank's ``out`` (``n`` ranks in the process set)."""
    if n & (n - 1):
        raise HorovodUnsupportedError(
            f"hvd.allreduce(op=hvd.Adasum) on {n} ranks: Adasum runs on a power-of-two number of ranks "
            "(as in Horovod). Use op=hvd.Average, or 2, 4, 8, ... ranks.")
    if n == 1:
        return out
    gathered = phalanx.allgather(out.detach().contiguous(), group=group)
    flat = gathered.reshape(n, -1).double()
    result = combine([flat[i] for i in range(n)])
    out.copy_(result.reshape(out.shape).to(out.dtype))
    return out

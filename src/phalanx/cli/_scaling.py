"""The scaling model behind ``phalanx bench predict``: step time on N ranks from an α-β network model.

::

    T(N)  = T1 + overhead + T_comm(N) + T_codec - hidden          (T(1) = T1)
    hidden = min(overlap x T_comm(N), backward_fraction x T1)
    efficiency = T1 / T(N)                                        (weak scaling)

    ring allreduce of S bytes on N ranks over a link (α, β):  2(N-1)α + 2(N-1)/N · S·β

Pure Python (no torch, no numpy), so it can be imported and tested anywhere; what each
term assumes is in ``docs/scaling.md``.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

from .._errors import InvalidArgumentError
from ._scaling_data import LINKS, MODELS, Link, ModelShape

__all__ = ["Fabric", "Settings", "Variant", "codec_flops", "comm_time", "compressed_matrices", "fit_allreduce",
           "parse_variant", "predict",
           "ring_allreduce", "step_time", "variant_bytes"]

VARIANT_WORDS = ("plain", "bf16", "fp16", "powersgd", "hierarchical")


@dataclasses.dataclass(frozen=True)
class Fabric:
    """Where the bytes go: ``inter`` (between hosts) and ``intra`` (within a host) link classes."""

    inter: Link
    intra: Link
    name: str = ""


@dataclasses.dataclass(frozen=True)
class Variant:
    """How a step reduces its gradients: ``wire_bytes`` per fp32 value sent (4, or 2 for bf16/fp16),
    ``powersgd`` (low-rank P and Q instead of the matrices) and ``hierarchical`` (within a host
    first, then one leader per host)."""

    name: str
    wire_bytes: int = 4
    powersgd: bool = False
    hierarchical: bool = False


@dataclasses.dataclass(frozen=True)
class Settings:
    """The model's free parameters (see ``docs/scaling.md``): ``t1`` seconds of one rank's step;
    ``ranks_per_host``; ``overlap`` (fraction of communication hidden behind backward, 0..1);
    ``backward_fraction`` (of ``t1``, the most that can hide it); ``rank`` (PowerSGD's);
    ``bucket_bytes`` (one allreduce per bucket); ``cast_s_per_byte`` (bf16/fp16 cast, per fp32
    byte, both ways); ``flops_per_s`` (PowerSGD's matrix products; 0 = free); ``overhead``
    (seconds a step on N > 1 ranks adds besides the transfers)."""

    t1: float
    ranks_per_host: int = 1
    overlap: float = 0.0
    backward_fraction: float = 2 / 3
    rank: int = 4
    bucket_bytes: int = 25 << 20
    cast_s_per_byte: float = 0.0
    flops_per_s: float = 0.0
    overhead: float = 0.0
    min_compression_rate: float = 2.0


def parse_variant(text: str) -> Variant:
    """``"plain"``, ``"bf16"``, ``"fp16"``, ``"powersgd"``, ``"hierarchical"`` or ``+``-joined ones
    (``"hierarchical+bf16"``) as a :class:`Variant`; raises InvalidArgumentError for others."""
    words = [w.strip().lower() for w in text.split("+") if w.strip()]
    bad = [w for w in words if w not in VARIANT_WORDS]
    if bad or not words:
        raise InvalidArgumentError(
            f"phalanx bench predict: --variants has {text!r}; a variant is one of {', '.join(VARIANT_WORDS)} "
            f"or several joined by '+', e.g. --variants plain,bf16,powersgd,hierarchical+bf16.")
    return Variant(text, wire_bytes=2 if ("bf16" in words or "fp16" in words) else 4,
                   powersgd="powersgd" in words, hierarchical="hierarchical" in words)


def ring_allreduce(nbytes: float, n: int, link: Link, rounds: int = 1) -> float:
    """Seconds of ``rounds`` ring allreduces carrying ``nbytes`` in all over ``n`` ranks on ``link``:
    ``rounds·2(n-1)α + 2(n-1)/n·nbytes·β`` (0 for one rank)."""
    if n <= 1:
        return 0.0
    return rounds * 2 * (n - 1) * link.alpha + 2 * (n - 1) / n * nbytes * link.beta


def comm_time(nbytes: float, n: int, fabric: Fabric, ranks_per_host: int = 1, hierarchical: bool = False,
              rounds: int = 1) -> float:
    """Seconds to allreduce ``nbytes`` (in ``rounds`` separate allreduces) over ``n`` ranks, packed
    ``ranks_per_host`` to a host.

    Flat: one ring over all ranks; when it crosses hosts every step waits for its slowest
    link, the inter-host one. Hierarchical: reduce to a leader within each host
    (reduce-scatter + gather), ring allreduce among the leaders, broadcast within each host
    (scatter + allgather); both intra steps cost a ring allreduce's ``2(R-1)α + 2(R-1)/R·Sβ``.
    """
    per_host = max(1, min(ranks_per_host, n))
    hosts = math.ceil(n / per_host)
    if hosts == 1:
        return ring_allreduce(nbytes, n, fabric.intra, rounds)
    if not hierarchical or per_host == 1:
        return ring_allreduce(nbytes, n, fabric.inter, rounds)
    within = ring_allreduce(nbytes, per_host, fabric.intra, rounds)
    return 2 * within + ring_allreduce(nbytes, hosts, fabric.inter, rounds)


def _compressible(rows: int, cols: int, s: Settings) -> bool:
    """PowerSGD compresses a matrix only where it saves (DDP's rule: (rows+cols)·r·rate < rows·cols)."""
    return (rows + cols) * s.rank * s.min_compression_rate < rows * cols


def codec_flops(rows: int, cols: int, rank: int) -> float:
    """PowerSGD's flops for one rows×cols matrix at ``rank``: ``6nmr + 2nr²`` (P = MQ, Q = MᵀP,
    M ≈ PQᵀ, Gram-Schmidt)."""
    return 6.0 * rows * cols * rank + 2.0 * rows * rank ** 2


def compressed_matrices(model: ModelShape, s: Settings) -> list[tuple[int, int]]:
    """The matrices of ``model`` PowerSGD compresses at ``s.rank`` (the others travel as they are)."""
    return [(rows, cols) for rows, cols in model.matrices if _compressible(rows, cols, s)]


def variant_bytes(model: ModelShape, variant: Variant, s: Settings) -> tuple[float, int, float, int]:
    """(bytes sent per step per rank, allreduce rounds, codec flops, values cast to 16 bits) of
    ``variant`` on ``model``.

    Plain/bf16: every gradient at ``wire_bytes`` per value, one allreduce per bucket.
    PowerSGD (Vogels et al. 2019): per compressible matrix n×m, P (n×r) then Q (m×r) in
    fp32, ``Σ r(n+m)`` values in two allreduces; the rest (vectors, small matrices) in a
    third; flops ``6nmr + 2nr²`` per matrix (P = MQ, Q = MᵀP, M ≈ PQᵀ, Gram-Schmidt).
    """
    if not variant.powersgd:
        nbytes = model.params * variant.wire_bytes
        cast = model.params if variant.wire_bytes < 4 else 0
        return nbytes, max(1, math.ceil(nbytes / s.bucket_bytes)), 0.0, cast
    low_rank, rest, flops = 0, model.vectors, 0.0
    for rows, cols in model.matrices:
        if _compressible(rows, cols, s):
            low_rank += s.rank * (rows + cols)
            flops += codec_flops(rows, cols, s.rank)
        else:
            rest += rows * cols
    return 4.0 * low_rank + variant.wire_bytes * rest, (3 if rest else 2) if low_rank else 1, flops, rest if variant.wire_bytes < 4 else 0


def step_time(n: int, model: ModelShape, variant: Variant, fabric: Fabric, s: Settings) -> dict[str, float]:
    """The predicted step on ``n`` ranks: ``step_s``, ``comm_s``, ``codec_s``, ``hidden_s``,
    ``bytes`` (sent per rank per step) and ``efficiency`` (= t1 / step_s)."""
    nbytes, rounds, flops, cast = variant_bytes(model, variant, s)
    if n <= 1:
        return {"step_s": s.t1, "comm_s": 0.0, "codec_s": 0.0, "hidden_s": 0.0, "bytes": 0.0, "efficiency": 1.0}
    comm = comm_time(nbytes, n, fabric, s.ranks_per_host, variant.hierarchical, rounds)
    codec = s.cast_s_per_byte * 4 * cast
    if flops and s.flops_per_s > 0:
        codec += flops / s.flops_per_s
    hidden = min(s.overlap * comm, s.backward_fraction * s.t1)
    step = s.t1 + s.overhead + comm + codec - hidden
    return {"step_s": step, "comm_s": comm, "codec_s": codec, "hidden_s": hidden, "bytes": nbytes,
            "efficiency": s.t1 / step}


def predict(model: ModelShape, variants: Sequence[Variant], ranks: Sequence[int], fabric: Fabric,
            s: Settings) -> list[dict[str, object]]:
    """One row per (variant, n): :func:`step_time`'s figures with ``variant`` and ``ranks``."""
    return [{"variant": v.name, "ranks": n, **step_time(n, model, v, fabric, s)} for v in variants for n in ranks]


def fit_allreduce(sizes: Sequence[float], seconds: Sequence[float], n: int) -> dict[str, float]:
    """Fit a link's α and β to allreduce timings on ``n`` ranks (``seconds[i]`` for ``sizes[i]`` bytes).

    Least squares of the relative error of ``t = a + b·S`` (weights 1/t², so small and large
    messages count alike), then ``α = a / 2(n-1)`` and ``β = b·n / 2(n-1)`` from the ring
    formula. Returns ``alpha``, ``beta``, ``gbytes_per_s`` (1/β) and ``rms_rel_error`` of the
    fit; raises InvalidArgumentError for fewer than two distinct sizes or ``n < 2``.
    """
    if n < 2 or len(set(sizes)) < 2 or len(sizes) != len(seconds) or min(seconds, default=0) <= 0:
        raise InvalidArgumentError(
            f"phalanx bench: an α-β fit needs allreduce timings on 2 or more ranks (got {n}) for 2 or more "
            f"distinct sizes with positive times (got sizes {list(sizes)}); pass e.g. --sizes 64K,1M,16M.")
    w = [1.0 / t ** 2 for t in seconds]
    sw = sum(w)
    sx = sum(wi * x for wi, x in zip(w, sizes, strict=True))
    sy = sum(wi * y for wi, y in zip(w, seconds, strict=True))
    sxx = sum(wi * x * x for wi, x in zip(w, sizes, strict=True))
    sxy = sum(wi * x * y for wi, x, y in zip(w, sizes, seconds, strict=True))
    det = sw * sxx - sx * sx
    b = (sw * sxy - sx * sy) / det
    a = (sy - b * sx) / sw
    if a < 0:  # latency below resolution: refit through the origin
        a, b = 0.0, sxy / sxx
    b = max(b, 0.0)
    rel = [(a + b * x - t) / t for x, t in zip(sizes, seconds, strict=True)]
    beta = b * n / (2 * (n - 1))
    return {"alpha": a / (2 * (n - 1)), "beta": beta, "gbytes_per_s": 1 / beta / 1e9 if beta else math.inf,
            "rms_rel_error": math.sqrt(sum(r * r for r in rel) / len(rel))}


def named_link(name: str, flag: str) -> Link:
    """The link called ``name`` in :data:`LINKS`; raises InvalidArgumentError naming ``flag`` otherwise."""
    try:
        return LINKS[name.lower()]
    except KeyError:
        raise InvalidArgumentError(
            f"phalanx bench predict: {flag} {name!r} is not a named link; use one of {', '.join(LINKS)} or a JSON "
            f"file written by `phalanx bench allreduce --json FILE`.") from None


def named_model(name: str) -> ModelShape:
    """The model called ``name`` in :data:`MODELS`; raises InvalidArgumentError otherwise."""
    try:
        return MODELS[name.lower()]
    except KeyError:
        raise InvalidArgumentError(
            f"phalanx bench predict: --model {name!r} is neither a named model ({', '.join(MODELS)}) nor a JSON "
            f"file; pass one of those, a file {{\"matrices\": [[rows, cols], ...], \"vectors\": N}}, or "
            f"--params N instead.") from None

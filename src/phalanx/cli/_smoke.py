"""The rank program of ``phalanx demo --smoke``: every collective, checked against what it must give.

Run as ``phalanx run -n 2 -m phalanx.cli._smoke``. Rank r contributes the
value r + 1; every rank checks every result, and the ranks agree on the
verdict (an allreduce of "all my checks passed") before rank 0 says OK.
"""

from __future__ import annotations

import numpy as np

import phalanx


def main() -> None:
    phalanx.init()
    rank, size = phalanx.rank(), phalanx.size()
    backend = phalanx.backend().name
    value = float(rank + 1)
    values = [float(r + 1) for r in range(size)]
    phalanx.print(f"my value is {value:g}")

    checks = {
        "allreduce sum": (phalanx.allreduce(value, op="sum"), sum(values)),
        "allreduce avg": (phalanx.allreduce(value, op="avg"), sum(values) / size),
        "allreduce max": (phalanx.allreduce(value, op="max"), max(values)),
        "broadcast from rank 0": (phalanx.broadcast(np.array([value * 10])), np.array([values[0] * 10])),
        "allgather": (phalanx.allgather(np.array([value])), np.array(values)[:, None]),
    }
    wrong = [name for name, (got, want) in checks.items() if not np.allclose(got, want)]
    for name in wrong:
        got, want = checks[name]
        phalanx.print(f"WRONG {name}: got {np.ravel(got).tolist()}, expected {np.ravel(want).tolist()}")
    agreed = phalanx.allreduce(np.array([0 if wrong else 1], np.int32), op="min")[0] == 1

    if rank == 0:
        shown = ", ".join(f"{v:g}" for v in values)
        for name, (got, _) in checks.items():
            phalanx.print(f"{name} of [{shown}] -> {np.asarray(got).tolist()}")
        if agreed:
            phalanx.print(f"OK: {size} process{'es' if size != 1 else ''} agreed on every collective (backend {backend})")
    phalanx.shutdown()
    if not agreed:
        what = ", ".join(wrong) if wrong else "the results of another rank"
        raise SystemExit(f"phalanx demo: rank {rank}: the ranks disagree on {what} (backend {backend})")


if __name__ == "__main__":
    main()

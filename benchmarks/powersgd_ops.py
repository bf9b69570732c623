"""PowerSGD's matrix work on the benchmark MLP, one thread: each product timed alone, in both layouts of ``Q``.

::

    flock /tmp/phalanx-tests.lock python benchmarks/powersgd_ops.py --repeats 30

The six weight matrices of ``train_step_worker.py``'s MLP (1024×512, 4 × 1024×1024, 10×1024),
rank 4. ``Q`` stored k×r (as phalanx did before) against r×k (``Qᵀ``, as ``torch/_powersgd.py``
keeps it now): the same products, written so that MKL gets a row-major left operand. Prints the
median ms per step of each operation over every matrix, and the totals.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch

SHAPES = [(1024, 512)] + [(1024, 1024)] * 4 + [(10, 1024)]


def _median_ms(fn: Callable[[], object], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--repeats", type=int, default=30)
    p.add_argument("--rank", type=int, default=4)
    args = p.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    r = args.rank
    mats = []
    for n, k in SHAPES:
        q = torch.linalg.qr(torch.randn(k, r)).Q.contiguous()
        mats.append({"m": torch.randn(n, k), "e": torch.randn(n, k) * 0.01, "q": q, "qT": q.t().contiguous(),
                     "p": torch.zeros(n, r), "qn": torch.zeros(k, r), "qnT": torch.zeros(r, k)})
    old = {
        "P = M Q": lambda x: torch.matmul(x["m"], x["q"], out=x["p"]),
        "Q = Mᵀ P": lambda x: torch.matmul(x["m"].t(), x["p"], out=x["qn"]),
        "error = M − P Qᵀ": lambda x: torch.addmm(x["m"], x["p"], x["qn"].t(), alpha=-1, out=x["e"]),
        "M = P Qᵀ": lambda x: torch.matmul(x["p"], x["qn"].t(), out=x["m"]),
    }
    new = {
        "P = M Q": lambda x: torch.matmul(x["m"], x["qT"].t(), out=x["p"]),
        "Q = Mᵀ P": lambda x: torch.matmul(x["p"].t(), x["m"], out=x["qnT"]),
        "error = M − P Qᵀ": lambda x: torch.addmm(x["m"], x["p"], x["qnT"], alpha=-1, out=x["e"]),
        "M = P Qᵀ": lambda x: torch.matmul(x["p"], x["qnT"], out=x["m"]),
    }
    print(f"| operation (all {len(SHAPES)} matrices, rank {r}) | Q stored k×r, ms | Q stored r×k, ms |")
    print("|---|---:|---:|")
    totals = [0.0, 0.0]
    for name in old:
        row = []
        for i, table in enumerate((old, new)):
            ms = _median_ms(lambda t=table, nm=name: [t[nm](x) for x in mats], args.repeats)
            totals[i] += ms
            row.append(ms)
        print(f"| {name} | {row[0]:.2f} | {row[1]:.2f} |")
    add = _median_ms(lambda: [x["m"].add_(x["e"]) for x in mats], args.repeats)
    print(f"| M += error (both) | {add:.2f} | {add:.2f} |")
    print(f"| total | {totals[0] + add:.2f} | {totals[1] + add:.2f} |")


if __name__ == "__main__":
    main()

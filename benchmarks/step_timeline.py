"""Where one training step's time goes across simulated hosts: per-rank event times of the benchmark MLP.

::

    flock /tmp/phalanx-tests.lock python benchmarks/step_timeline.py --compression bf16 --backend mpi
    flock /tmp/phalanx-tests.lock python benchmarks/step_timeline.py --compression powersgd --backend gloo

Builds ``--hosts`` simulated hosts (``--rate`` links, as ``benchmarks/multihost.py``), runs
``--steps`` steps of the MLP with ``phalanx.torch.DistributedOptimizer`` under ``phalanx run``,
and prints, for ranks 0 and 1, the last step's events in ms from its start:

* ``fwd``, ``bwd`` (``loss.backward()`` returned: every bucket reduced), ``step``;
* ``launchB``: bucket ``B``'s reduction posted (from the gradient hooks, or at the end of backward);
* ``wait``/``done``: the engine starts and ends waiting for a bucket;
* ``ringT:a->b``: the mpi ring with tag ``T`` moved from step ``a`` to ``b`` (``2 (size-1)`` steps a
  block of at most 4 MiB, then the next block);
* ``c:NAME``/``e:NAME``: PowerSGD's calls (``iallreduce`` posts, ``wait`` waits) start and end.

It wraps phalanx's internal methods to record times (diagnosis only; nothing is changed).
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any


def _worker(args: argparse.Namespace) -> None:
    import torch
    from torch import nn

    import phalanx
    import phalanx.torch as pt
    from phalanx.comm import _ring
    from phalanx.torch import _bucket, _powersgd

    torch.set_num_threads(1)
    phalanx.init()
    events: list[tuple[str, float]] = []
    t0 = [0.0]

    def mark(name: str) -> None:
        events.append((name, (time.perf_counter() - t0[0]) * 1e3))

    def wrap(owner: Any, name: str, before: Any, after: Any = None) -> None:
        original = getattr(owner, name)

        def wrapped(*a: Any) -> Any:
            before(*a)
            out = original(*a)
            if after is not None:
                after(out, *a)
            return out
        setattr(owner, name, wrapped)

    wrap(_bucket.GradientBuckets, "_launch", lambda self, b: mark(f"launch{b}"))
    wrap(_bucket.GradientBuckets, "_complete", lambda self, bucket: mark("wait"), lambda out, *a: mark("done"))
    original_call = _powersgd._call

    def call(world: Any, name: str, fn: Any, *a: Any) -> Any:
        label = getattr(fn, "__name__", "call")
        mark("c:" + label)
        out = original_call(world, name, fn, *a)
        mark("e:" + label)
        return out
    _powersgd._call = call
    original_advance = _ring.Ring._advance

    def advance(self: Any) -> bool:
        before = self._step
        done = original_advance(self)
        if self._step != before or done:
            mark(f"ring{self._tag}:{before}->{self._step}")
        return done
    _ring.Ring._advance = advance  # type: ignore[method-assign]

    width = 1024
    layers: list[Any] = [nn.Linear(512, width), nn.ReLU()]
    for _ in range(4):
        layers += [nn.Linear(width, width), nn.ReLU()]
    model = nn.Sequential(*layers, nn.Linear(width, 10))
    compression: Any = args.compression or None
    if compression == "powersgd":
        compression = pt.PowerSGD(rank=4, warmup_steps=2)
    opt = pt.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01),
                                  named_parameters=model.named_parameters(), compression=compression)
    x, y = torch.randn(64, 512), torch.randint(0, 10, (64,))
    for _ in range(args.steps):
        events.clear()
        t0[0] = time.perf_counter()
        opt.zero_grad()
        loss = nn.functional.cross_entropy(model(x), y)
        mark("fwd")
        loss.backward()
        mark("bwd")
        opt.step()
        mark("step")
    if phalanx.rank() in (0, 1):
        print(f"rank {phalanx.rank()}: " + " ".join(f"{n}@{t:.1f}" for n, t in events), flush=True)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--hosts", type=int, default=4)
    p.add_argument("--rate", default="1gbit")
    p.add_argument("--backend", choices=["mpi", "gloo"], default="mpi")
    p.add_argument("--compression", choices=["", "bf16", "fp16", "powersgd"], default="")
    p.add_argument("--steps", type=int, default=8, help="steps run; the last one is printed (default 8)")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        _worker(args)
        return 0
    from phalanx.testing import simulated_hosts

    with simulated_hosts(args.hosts, rate=args.rate) as hosts:
        hostlist = ",".join(f"h{i}:1" for i in range(args.hosts))
        cmd = [sys.executable, "-m", "phalanx", "run", "--backend", args.backend, "--hosts", hostlist,
               "--rsh", hosts.rsh, __file__, "--worker", "--steps", str(args.steps),
               "--compression", args.compression]
        done = hosts.run(0, cmd, capture_output=True, text=True, timeout=300)
    lines = sorted(line for line in done.stdout.splitlines() if line.startswith("rank "))
    print("\n".join(lines) if lines else done.stdout[-3000:] + done.stderr[-3000:])
    return 0 if lines and done.returncode == 0 else 1


if __name__ == "__main__":
    raise SystemExit(main())

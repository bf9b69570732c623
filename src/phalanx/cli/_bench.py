"""``phalanx bench allreduce|broadcast|predict``: phalanx against the raw libraries, same run, same buffers.

Launched alone, it starts a world of ``-n`` ranks through ``phalanx run`` and
re-enters itself in every rank (``--worker``). In an MPI world it measures, on
the same buffers and interleaved: phalanx on MPI, raw mpi4py, phalanx on Gloo
and raw ``torch.distributed`` (Gloo); in a Gloo world, the last two. Each
figure is the median of ``--repeats`` timings, each timing the slowest rank's
mean over enough iterations to last ``--min-time`` seconds.

Bandwidths follow nccl-tests: algorithm bandwidth = bytes / time; bus
bandwidth = algbw x 2(n-1)/n for allreduce (x 1 for broadcast).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from contextlib import contextmanager
from typing import Any

__all__ = ["main"]

DEFAULT_SIZES = [4, 8, 64, 1024, 16 << 10, 256 << 10, 1 << 20, 4 << 20, 16 << 20, 64 << 20]


def _parse_size(text: str) -> int:
    units = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30}
    text = text.strip().lower().rstrip("b").rstrip("i")
    if text and text[-1] in units:
        return int(float(text[:-1]) * units[text[-1]])
    return int(text)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="phalanx bench", description=__doc__.split("\n\n")[0])
    p.add_argument("collective", choices=["allreduce", "broadcast", "predict"],
                   help="what to time; `predict` (the α-β model's forecast) has its own options: "
                        "phalanx bench predict -h")
    p.add_argument("-n", "--nprocs", type=int, default=2, help="ranks to start (default 2)")
    p.add_argument("--backend", choices=["mpi", "gloo"], default=None,
                   help="world to start (default: mpi when available, else gloo)")
    p.add_argument("--sizes", default=None,
                   help="comma-separated message sizes in bytes, e.g. 8,1M,64M (default 4 B .. 64 MiB)")
    p.add_argument("--repeats", type=int, default=7, help="timings per figure; the median is reported")
    p.add_argument("--min-time", type=float, default=0.05, help="seconds each timing lasts at least")
    p.add_argument("--json", dest="json_path", default=None,
                   help="also write the results (and, for allreduce, the α-β fit) here")
    p.add_argument("-H", "--hosts", default=None,
                   help="run the ranks on these hosts, `phalanx run --hosts` style (H0:N,H1:N)")
    p.add_argument("--rsh", default=None, help="with --hosts: the ssh-style command (`phalanx run --rsh`)")
    p.add_argument("--link-rate", default=None,
                   help="the link's rate, e.g. 1gbit: also print bus bandwidth as a fraction of it")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    return p


def main(argv: list[str] | None = None) -> int:
    """Run ``phalanx bench`` with ``argv``; returns the exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["predict"]:
        from ._predict import main as predict_main

        return predict_main(argv[1:])
    args = _parser().parse_args(argv)
    if args.worker:
        return _worker(args)
    if args.link_rate is not None:
        from .._errors import InvalidArgumentError

        try:
            _link_rate(args.link_rate)  # a bad rate fails here, not in every rank
        except InvalidArgumentError as exc:
            sys.stderr.write(f"{exc}\n")
            return 2
    cmd = [sys.executable, "-m", "phalanx", "run", "-n", str(args.nprocs)]
    if args.backend:
        cmd += ["--backend", args.backend]
    if args.hosts:
        cmd += ["--hosts", args.hosts] + (["--rsh", args.rsh] if args.rsh else [])
    cmd += ["-m", "phalanx.cli._bench", "--worker", *argv]
    return subprocess.call(cmd)


def _link_rate(text: str) -> float:
    """``--link-rate`` in bytes per second: ``1gbit``, ``100mbit``, ``10mbps`` (bytes), or bits per second."""
    import re

    from .._errors import InvalidArgumentError

    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(bit|bps)?\s*", text, re.IGNORECASE)
    if not m or float(m[1]) <= 0:
        raise InvalidArgumentError(f"phalanx bench: --link-rate {text!r} is not a positive rate; pass e.g. "
                                   f"1gbit, 100mbit or 10mbps (bytes per second).")
    value = float(m[1]) * {"": 1, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12}[m[2].lower()]
    return value if (m[3] or "").lower() == "bps" else value / 8


# -- inside the world ------------------------------------------------------------------------

@contextmanager
def _as_global(world: Any):
    """Run phalanx's public functions against ``world`` (a second backend in the same processes)."""
    from .. import _world

    saved = _world.swap(world)
    try:
        yield
    finally:
        _world.swap(saved)


def _gloo_beside_mpi(mpi_comm: Any) -> Any:
    """Start a Gloo process group in an MPI world (rank 0 chooses address, port and secret, sent over MPI)."""
    import secrets
    import socket

    names = mpi_comm.allgather(socket.gethostname())
    one_host = len(set(names)) == 1
    port, addr, secret = 0, "127.0.0.1", ""
    if mpi_comm.rank == 0:
        with socket.socket() as s:
            s.bind(("127.0.0.1" if one_host else "", 0))
            port = s.getsockname()[1]
        if not one_host:  # the address other hosts know this one by (its name in /etc/hosts or DNS)
            addr, secret = socket.gethostbyname(names[0]), os.environ.get("PHALANX_SECRET") or secrets.token_hex(32)
    port, addr, secret = mpi_comm.bcast((port, addr, secret), root=0)
    here = names[mpi_comm.rank]
    os.environ.update(MASTER_ADDR=addr, MASTER_PORT=str(port), RANK=str(mpi_comm.rank),
                      WORLD_SIZE=str(mpi_comm.size), LOCAL_RANK=str(names[:mpi_comm.rank].count(here)),
                      LOCAL_WORLD_SIZE=str(names.count(here)))
    if secret:
        os.environ["PHALANX_SECRET"] = secret
    from .._world import World
    from ..comm._torch import TorchBackend

    world = _current()
    return World(TorchBackend("gloo", timeout=world.timeout, devices=None), timeout=world.timeout,
                 check=world.check, debug=False, devices=None)


def _current() -> Any:
    from .. import _world

    return _world.current("bench")


Impl = tuple[str, Any, Callable[[Any, Any], Callable[[], Any]]]  # (name, world or None, call maker)


def _implementations(main_world: Any, coll: str) -> list[Impl]:
    """phalanx and its raw baseline, in pairs: over MPI (and Gloo beside it when it starts), or torch's."""
    import torch

    impls: list[Impl] = []
    dist = torch.distributed
    rank = main_world.rank
    if main_world.backend.name == "mpi":
        MPI = main_world.backend.MPI
        raw_comm = MPI.COMM_WORLD.Dup()
        impls.append(("phalanx-mpi", main_world, _phalanx_call(coll)))
        impls.append(("mpi4py", None, _mpi_call(coll, raw_comm, MPI)))
        try:
            gloo_world = _gloo_beside_mpi(raw_comm)
        except Exception as exc:  # noqa: BLE001 - the comparison is optional, the report says why
            if rank == 0:
                print(f"phalanx bench: no Gloo comparison in this run ({exc})", file=sys.stderr)
        else:
            impls.append(("phalanx-gloo", gloo_world, _phalanx_call(coll)))
            impls.append(("torch.distributed-gloo", None, _torch_call(coll, dist)))
    else:
        impls.append((f"phalanx-{main_world.backend.name}", main_world, _phalanx_call(coll)))
        impls.append((f"torch.distributed-{main_world.backend.name}", None, _torch_call(coll, dist)))
    return impls


def _worker(args: argparse.Namespace) -> int:
    import numpy as np
    import torch

    import phalanx

    torch.set_num_threads(1)
    phalanx.init()
    main_world = _current()
    rank, size = main_world.rank, main_world.size
    sizes = [_parse_size(s) for s in args.sizes.split(",")] if args.sizes else DEFAULT_SIZES
    coll = args.collective
    impls = _implementations(main_world, coll)

    def slowest(seconds: float) -> float:
        with _as_global(main_world):
            return float(phalanx.allreduce(np.array(seconds), op="max"))

    results = []
    for nbytes in sizes:
        count = max(1, nbytes // 4)
        array = np.ones(count, np.float32)
        tensor = torch.from_numpy(array)  # the same memory for every implementation
        calls = {name: make(array, tensor) for name, _, make in impls}
        iters = {}
        for name, world, _ in impls:  # warm up and size each loop to last --min-time
            with _as_global(world or main_world):
                iters[name] = max(_calibrate(calls[name], args.min_time, slowest) for _ in range(2))
        for (a, _, _), (b, _, _) in zip(impls[::2], impls[1::2], strict=True):  # a pair runs the same loop
            iters[a] = iters[b] = max(iters[a], iters[b])
        samples: dict[str, list[float]] = {name: [] for name, _, _ in impls}
        for pair in zip(impls[::2], impls[1::2], strict=True):
            # phalanx and its baseline interleaved, so drift on a shared machine hits both alike,
            # alternating which goes first; the other transport's pair runs apart from them
            # (Gloo's threads and buffers would otherwise disturb the MPI timings).
            for repeat in range(args.repeats):
                for name, world, _ in (pair if repeat % 2 == 0 else pair[::-1]):
                    with _as_global(world or main_world):
                        samples[name].append(_time(calls[name], iters[name], slowest))
        row = {"bytes": count * 4, "iterations": iters,
               "seconds": {k: statistics.median(v) for k, v in samples.items()}, "samples": samples}
        results.append(row)
        if rank == 0:
            _print_row(row, coll, size, impls, first=nbytes == sizes[0],
                       limit=_link_rate(args.link_rate) if args.link_rate else None)
    with _as_global(main_world):  # hosts = ranks with local rank 0 (no pickled host names)
        hosts = int(phalanx.allreduce(np.array(int(phalanx.local_rank() == 0)), op="sum"))
    if rank == 0:
        summary = {"collective": coll, "ranks": size, "backend": main_world.backend.name,
                   "repeats": args.repeats, "check": main_world.check, "results": results,
                   "host": os.uname().nodename, "hosts": hosts, "link_rate": args.link_rate,
                   "time": time.strftime("%Y-%m-%dT%H:%M:%S")}
        if coll == "allreduce" and size > 1 and len(sizes) > 1:
            summary["fit"] = _fit(results, size, "inter" if hosts > 1 else "intra", [n for n, _, _ in impls])
            _print_fit(summary["fit"], args.link_rate)
        if args.json_path:
            with open(args.json_path, "w") as f:
                json.dump(summary, f, indent=1)
            print(f"\nresults written to {args.json_path}")
    return 0


def _fit(results: list[dict[str, Any]], size: int, link_class: str, names: list[str]) -> dict[str, Any]:
    """The α-β fit of each implementation's allreduce timings (``phalanx.cli._scaling.fit_allreduce``)."""
    from ._scaling import fit_allreduce

    sizes = [row["bytes"] for row in results]
    links = {name: fit_allreduce(sizes, [row["seconds"][name] for row in results], size) for name in names}
    return {"class": link_class, "ranks": size, "use": names[0], "links": links,
            "model": "t(S) = 2(n-1)alpha + 2(n-1)/n S beta, least squares of the relative error"}


def _print_fit(fit: dict[str, Any], link_rate: str | None) -> None:
    limit = _link_rate(link_rate) if link_rate else None
    print(f"\nα-β fit ({fit['class']} link class, {fit['ranks']} ranks): {fit['model']}")
    for name, link in fit["links"].items():
        versus = f"  = {link['gbytes_per_s'] * 1e9 / limit:.2f} of the {link_rate} link" if limit else ""
        print(f"  {name:>24}: alpha {link['alpha'] * 1e6:9.2f} us  1/beta {link['gbytes_per_s']:8.4f} GB/s  "
              f"(rms error {link['rms_rel_error']:.1%}){versus}")


def _calibrate(call: Callable[[], Any], min_time: float, slowest: Callable[[float], float]) -> int:
    for _ in range(3):
        call()
    iters = 1
    while True:
        elapsed = _time(call, iters, slowest) * iters
        if elapsed >= min_time or iters >= 100_000:
            return iters
        iters = min(100_000, max(iters * 2, int(iters * min_time / max(elapsed, 1e-9) * 1.2)))


def _time(call: Callable[[], Any], iters: int, slowest: Callable[[float], float]) -> float:
    slowest(0.0)  # line the ranks up
    start = time.perf_counter()
    for _ in range(iters):
        call()
    return slowest(time.perf_counter() - start) / iters


def _phalanx_call(coll: str) -> Callable[[Any, Any], Callable[[], Any]]:
    import phalanx

    def make(array: Any, tensor: Any) -> Callable[[], Any]:
        if coll == "allreduce":
            return lambda: phalanx.allreduce(array)
        return lambda: phalanx.broadcast(array, root=0)

    return make


def _mpi_call(coll: str, comm: Any, MPI: Any) -> Callable[[Any, Any], Callable[[], Any]]:
    def make(array: Any, tensor: Any) -> Callable[[], Any]:
        if coll == "allreduce":
            return lambda: comm.Allreduce(MPI.IN_PLACE, array, MPI.SUM)
        return lambda: comm.Bcast(array, root=0)

    return make


def _torch_call(coll: str, dist: Any) -> Callable[[Any, Any], Callable[[], Any]]:
    def make(array: Any, tensor: Any) -> Callable[[], Any]:
        if coll == "allreduce":
            return lambda: dist.all_reduce(tensor)
        return lambda: dist.broadcast(tensor, src=0)

    return make


def _fmt_bytes(n: int) -> str:
    for unit, scale in (("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            return f"{n / scale:g} {unit}"
    return f"{n} B"


def _print_row(row: dict[str, Any], coll: str, size: int, impls: list[Any], first: bool,
               limit: float | None = None) -> None:
    names = [name for name, _, _ in impls]
    factor = 2 * (size - 1) / size if coll == "allreduce" and size > 1 else 1.0
    if first:
        head = f"{'size':>9} " + " ".join(f"{n + ' us':>26}" for n in names)
        head += "   ratios (phalanx/raw)  busbw GB/s (" + names[0] + ")" + ("  of link" if limit else "")
        print(f"phalanx bench {coll}: {size} ranks, median of timings, time of the slowest rank")
        print(head)
    secs = row["seconds"]
    cells = " ".join(f"{secs[n] * 1e6:>26.2f}" for n in names)
    ratios = []
    for i in range(0, len(names) - 1, 2):
        ratios.append(f"{secs[names[i]] / secs[names[i + 1]]:.3f}")
    busbw = row["bytes"] / secs[names[0]] * factor / 1e9
    of_link = f"  {busbw * 1e9 / limit:8.2f}" if limit else ""
    print(f"{_fmt_bytes(row['bytes']):>9} {cells}   {' '.join(ratios):>21}  {busbw:10.3f}{of_link}", flush=True)


if __name__ == "__main__":
    raise SystemExit(main())

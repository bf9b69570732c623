"""Rank bodies for the reliability tests: step labels, listeners, stopped store hosts, early shutdown."""

from __future__ import annotations

import ipaddress
import os
import signal
import time
from typing import Any

import numpy as np

import phalanx
from behaviours import Behaviours
from helpers import preload_torch, raises

preload_torch()  # the stall bodies here use torch under 2 s timeouts: no rank may still be importing it

STEPS = Behaviours()


@STEPS.behaviour("skipped-step-raises-at-the-first-mismatched-call-naming-each-ranks-step")
def _() -> None:
    r, n = phalanx.rank(), phalanx.size()
    done = []
    with raises(phalanx.CollectiveMismatchError, f"rank {r}: the skipped step was not caught (steps done: {done})") as raised:
        for s in range(5):
            if r == 1 and s == 2:
                continue  # rank 1 skips step 2's allreduce and carries on
            total = phalanx.allreduce(np.full(2, float(s)), step=s)
            assert np.array_equal(total, np.full(2, float(s * n))), f"step {s} mixed with another step: {total}"
            done.append(s)
    exc = raised.value
    text = str(exc)
    # Every rank raises at its first mismatched call: step 2 on the others, step 3 on rank 1.
    assert done == [0, 1], f"rank {r} completed steps {done} before the error"
    assert "step differs" in text, text
    assert "rank 1 at allreduce (call #3, step 3)" in text, text
    others = [q for q in range(n) if q != 1]
    assert f"rank{'s' if len(others) > 1 else ''} {others if len(others) > 1 else others[0]} at allreduce " \
           "(call #3, step 2)" in text, text
    assert phalanx.allreduce(1) == n, "the world is usable after the mismatch"


@STEPS.behaviour("without-labels-call-differs-names-which-rank-is-at-which-call")
def _() -> None:
    r, n = phalanx.rank(), phalanx.size()
    start = phalanx.allreduce(0)  # noqa: F841 - lines up the call counters of every rank
    with raises(phalanx.CollectiveMismatchError, "the skipped call was never caught") as raised:
        for s in range(4):
            if not (r == 1 and s == 2):
                phalanx.allreduce(np.ones(2))
        phalanx.barrier()
    exc = raised.value
    text = str(exc)
    assert "call differs" in text, text
    assert "Where each rank is:" in text and "rank 1 at barrier (call #" in text, text
    assert "at allreduce (call #" in text, text
    assert phalanx.allreduce(1) == n


def steps() -> dict[str, str | None]:
    return STEPS.run()


LISTENERS = Behaviours()


def _listening(pids: list[int]) -> list[tuple[Any, int]]:
    """``(address, port)`` of every TCP socket the processes ``pids`` listen on (from /proc)."""
    inodes = set()
    for pid in pids:
        fd_dir = f"/proc/{pid}/fd"
        for fd in os.listdir(fd_dir):
            try:
                target = os.readlink(os.path.join(fd_dir, fd))
            except OSError:
                continue
            if target.startswith("socket:["):
                inodes.add(target[8:-1])
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            for line in f.readlines()[1:]:
                fields = line.split()
                if fields[3] == "0A" and fields[9] in inodes:  # 0A: LISTEN
                    address, port = fields[1].split(":")
                    found.append((_address(address), int(port, 16)))
    return found


def _address(hexed: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address:
    """An address as /proc/net/tcp{,6} writes it (32-bit words in host byte order)."""
    raw = bytes.fromhex(hexed)
    address = ipaddress.ip_address(b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4)))
    mapped = getattr(address, "ipv4_mapped", None)
    return mapped or address


@LISTENERS.behaviour("every-listening-socket-of-a-single-host-gloo-job-is-on-loopback")
def _() -> None:
    pids = phalanx.allgather(np.int64(os.getpid())).tolist()
    phalanx.barrier()
    if phalanx.rank() == 0:
        found = _listening(pids)
        assert found, "found no listening socket at all (the store must listen somewhere)"
        exposed = [f"{a}:{p}" for a, p in found if not a.is_loopback]
        assert not exposed, f"the job listens beyond loopback: {exposed} (all: {found})"
    phalanx.barrier()


def listeners() -> dict[str, str | None]:
    return LISTENERS.run()


def store_host_stops() -> None:
    """Rank 0 (which serves the gloo store) stops dead; the others time out in an allreduce, then
    shut down: both must be prompt, and the report carries the times."""
    r = phalanx.rank()
    phalanx.barrier()
    if r == 0:
        os.kill(os.getpid(), signal.SIGSTOP)  # unreachable from here on, like a host behind a cut link
        time.sleep(60)
    start = time.monotonic()
    with raises(phalanx.CollectiveTimeoutError, "the allreduce with a stopped rank completed") as caught:
        phalanx.allreduce(np.ones(4))
    raised = time.monotonic() - start
    error = caught.value
    start = time.monotonic()
    phalanx.shutdown()
    closed = time.monotonic() - start
    raise RuntimeError(f"rank {r}: TIMES raised={raised:.2f} shutdown={closed:.2f} | {error}")


def early_shutdown() -> None:
    """Rank 1 calls shutdown() while the others wait in an allreduce: they must raise RankFailedError
    naming rank 1 at once, and rank 1 must leave at once."""
    r = phalanx.rank()
    phalanx.barrier()
    start = time.monotonic()
    if r == 1:
        phalanx.shutdown()
        print(f"rank 1: TIMES shutdown={time.monotonic() - start:.2f}", flush=True)
        time.sleep(60)  # stays alive: the others must not depend on its exit
        return
    try:
        phalanx.allreduce(np.ones(4))
    except phalanx.RankFailedError as exc:
        exc.add_note(f"rank {r}: TIMES raised={time.monotonic() - start:.2f}")
        raise


def handles_after_a_timeout() -> None:
    """Rank 0 starts an iallreduce that rank 1 never joins, then a barrier, which posts the handle
    first and times out: every later wait() on the handle raises that same error, never an
    internal one."""
    phalanx.barrier()
    if phalanx.rank() != 0:
        time.sleep(60)  # silent; stopped by the launcher once rank 0 fails
        return
    handle = phalanx.iallreduce(np.ones(4))
    start = time.monotonic()
    with raises(phalanx.CollectiveTimeoutError, "a barrier with a silent peer completed") as caught:
        phalanx.barrier()
    raised, error = time.monotonic() - start, caught.value
    for _ in range(2):
        with raises(phalanx.PhalanxError, "wait() on a handle whose peer never came completed") as again:
            handle.wait()
        exc = again.value
        assert exc is error, f"wait() raised {exc!r}, not the timeout {error!r}"
    raise RuntimeError(f"rank 0: TIMES raised={raised:.2f} | every wait() raised the same "
                       f"{type(error).__name__}: {error}")


def sharded_peer_stalls(shard: str, where: str) -> None:
    """Sharded training (``shard``) where rank 1 falls silent ``where`` ("backward": before its
    gradients' reduce-scatter or allreduce; "step": after backward, before the parameters'
    all-gather): rank 0 raises CollectiveTimeoutError within the timeout and its grace."""
    import torch

    import phalanx.torch as pt

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 512), torch.nn.ReLU(), torch.nn.Linear(512, 10))
    opt = pt.DistributedOptimizer(torch.optim.Adam(model.parameters()), shard=shard)
    x, y = torch.randn(8, 64), torch.randint(0, 10, (8,))

    def backward() -> None:
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()

    backward()
    opt.step()  # one whole step first: the failure is in a running job, not at set-up
    if phalanx.rank() == 1:
        if where == "step":
            backward()
        time.sleep(60)  # silent; stopped by the launcher once rank 0 fails
        return
    start = time.monotonic()
    with raises(phalanx.CollectiveTimeoutError, f"a sharded {where} with a silent peer completed") as caught:
        backward()
        opt.step()
    raise RuntimeError(f"rank 0: TIMES raised={time.monotonic() - start:.2f} | {caught.value}")


def one_more_step() -> None:
    """An uneven last batch: rank 0 makes one more DistributedOptimizer step after the others have
    finished (they return, and exiting shuts them down). Its gradient bucket skips the per-call
    agreement, so it must never pair with a peer's shutdown agreement (on gloo that aborted the
    process on a size mismatch): rank 0 raises CollectiveTimeoutError within the timeout, naming
    the ranks that are shutting down."""
    import torch

    import phalanx.torch as pt

    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    opt = pt.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))

    def step() -> None:
        opt.zero_grad()
        model(torch.randn(2, 4)).sum().backward()
        opt.step()

    for _ in range(2):
        step()
    if phalanx.rank() != 0:
        return
    start = time.monotonic()
    try:
        step()
    except phalanx.PhalanxError as exc:
        exc.add_note(f"rank 0: TIMES raised={time.monotonic() - start:.2f}")
        raise
    raise RuntimeError("rank 0: its extra step completed with no peer to reduce with")

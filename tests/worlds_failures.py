"""Rank bodies for the failure tests: mismatches, bad input, timeouts, crashes."""

from __future__ import annotations

import os
import signal
import time

import numpy as np

import phalanx

MISMATCHES = ["shape", "same_numel_other_shape", "dtype", "op", "root", "call", "skip", "nonblocking"]


def mismatches() -> dict[str, str]:
    """Each mismatch raises CollectiveMismatchError on every rank; the world stays usable."""
    r, n = phalanx.rank(), phalanx.size()
    x = np.ones(3)
    attempts = {
        "shape": lambda: phalanx.allreduce(np.ones(3 + r)),
        "same_numel_other_shape": lambda: phalanx.allreduce(np.ones((2, 3) if r == 0 else (3, 2))),
        "dtype": lambda: phalanx.allreduce(np.ones(3, np.float32 if r == 0 else np.int32)),
        "op": lambda: phalanx.allreduce(x, op="sum" if r == 0 else "max"),
        "root": lambda: phalanx.broadcast(x, root=0 if r == 0 else 1),
        "call": lambda: phalanx.allreduce(x) if r == 0 else phalanx.broadcast(x),
        # rank 1 skips the allreduce: its next call (a barrier) pairs with the others' allreduce
        "skip": lambda: phalanx.barrier() if r == 1 else (phalanx.allreduce(x), phalanx.barrier()),
        "nonblocking": lambda: phalanx.iallreduce(np.ones(2 + r)).wait(),
    }
    messages = {}
    for name in MISMATCHES:
        try:
            attempts[name]()
        except phalanx.CollectiveMismatchError as exc:
            messages[name] = str(exc)
        else:
            raise AssertionError(f"mismatch {name!r} was not detected on rank {r}")
        assert phalanx.allreduce(1) == n, f"world unusable after the {name!r} mismatch"
    return messages


def call_site_mismatch() -> str:
    """Debug mode: the same collective reached from different lines (calls out of order)."""
    x = np.ones(2)
    try:
        if phalanx.rank() == 0:
            phalanx.allreduce(x)  # first call on rank 0 ...
        else:
            phalanx.allreduce(x)  # ... pairs with a different call site on rank 1
    except phalanx.CollectiveMismatchError as exc:
        return str(exc)
    raise AssertionError("debug mode did not catch the call-site mismatch")


def bad_input() -> int:
    """Rank 0 makes bad calls that fail locally before anything is sent; then all ranks agree."""
    import torch

    r, n = phalanx.rank(), phalanx.size()
    if r == 0:
        bad = [
            (lambda: phalanx.broadcast(np.ones(2), root=n), ValueError, "root"),
            (lambda: phalanx.reduce(np.ones(2), root=-1), ValueError, "root"),
            (lambda: phalanx.gather(np.ones(2), root=1.0), ValueError, "root"),
            (lambda: phalanx.allreduce(np.ones(2), op="mean"), ValueError, "unknown op"),
            (lambda: phalanx.allreduce(np.ones(2, np.int64), op="avg"), TypeError, "avg"),
            (lambda: phalanx.allreduce(np.ones(2, bool)), TypeError, "bool"),
            (lambda: phalanx.allreduce(np.ones(2, np.complex64)), TypeError, "complex64"),
            (lambda: phalanx.allreduce(np.ones(2, np.uint16)), TypeError, "uint16"),
            (lambda: phalanx.allreduce(np.ones((3, 4))[:, ::2]), TypeError, "contiguous"),
            (lambda: phalanx.allreduce(torch.ones(3, 4).t()), TypeError, "contiguous"),
            (lambda: phalanx.allreduce([1.0, 2.0]), TypeError, "list"),
            (lambda: phalanx.allreduce("3"), TypeError, "str"),
            (lambda: phalanx.alltoall(np.float64(1.0)), TypeError, "equal chunks"),
            (lambda: phalanx.allreduce(2**70), TypeError, "int64"),
        ]
        if n > 1:  # any length splits into one chunk
            bad.append((lambda: phalanx.reduce_scatter(np.ones(n * 2 + 1)), TypeError, "equal chunks"))
        for call, kind, fragment in bad:
            try:
                call()
            except phalanx.PhalanxError as exc:
                assert isinstance(exc, kind), f"{type(exc).__mro__} is not a {kind}"
                assert fragment in str(exc), f"{fragment!r} not in {exc}"
                assert "phalanx." in str(exc), f"the error does not name the call: {exc}"
            except ValueError as exc:  # plain ValueErrors name the call too
                assert kind is ValueError and fragment in str(exc) and "phalanx." in str(exc), str(exc)
            else:
                raise AssertionError("a bad call was accepted")
    # Nothing was sent by the failed calls, so this pairs correctly on every rank.
    assert phalanx.allreduce(r + 1) == n * (n + 1) // 2
    return r


def sleeper_skips_allreduce() -> None:
    """The last rank never reaches the allreduce; the others must time out naming it."""
    r, n = phalanx.rank(), phalanx.size()
    if r == n - 1:
        time.sleep(60)  # stuck computing; killed when the job ends
        return
    phalanx.allreduce(np.ones(4))


def raises_on_rank_1() -> None:
    if phalanx.rank() == 1:
        raise ValueError("boom on rank 1")
    phalanx.allreduce(np.ones(4))
    time.sleep(60)  # never reached: the job must end because of rank 1


def killed_rank_1() -> None:
    phalanx.barrier()
    if phalanx.rank() == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    phalanx.allreduce(np.ones(4))
    time.sleep(60)

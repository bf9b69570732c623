"""Rank bodies for the failure tests: mismatches, bad input, timeouts, crashes."""

from __future__ import annotations

import os
import signal
import time
import zlib

import numpy as np

import phalanx
from behaviours import Behaviours
from helpers import preload_torch, raises

preload_torch()  # a bad-input body uses torch on rank 0 only while the others wait (4 s timeout)

MISMATCHES = Behaviours()
_mismatch = MISMATCHES.add


def _same_on_every_rank(text: str, what: str) -> None:
    """Every rank raised the same message (past its first line, which names the local call)."""
    mine = zlib.crc32("\n".join(text.split("\n")[1:]).encode())
    assert len(set(phalanx.allgather(np.int64(mine)).tolist())) == 1, f"{what}: ranks saw different errors"


def _expect_mismatch(attempt, *needles: str, what: str) -> None:
    """``attempt()`` raises CollectiveMismatchError on this rank, naming ``needles``; the world stays usable."""
    n = phalanx.size()
    missed = f"mismatch {what!r} was not detected on rank {phalanx.rank()}"
    with raises(phalanx.CollectiveMismatchError, missed) as raised:
        attempt()
    text = str(raised.value)
    missing = [s for s in needles if s not in text]
    assert not missing, f"{missing} not in: {text}"
    _same_on_every_rank(text, what)
    assert phalanx.allreduce(1) == n, f"world unusable after the {what!r} mismatch"


def _r() -> int:
    return phalanx.rank()


_mismatch("shape-names-both-shapes-and-ranks", lambda: _expect_mismatch(
    lambda: phalanx.allreduce(np.ones(3 + _r())), "phalanx.allreduce", "float64[3]", "float64[4]",
    "rank 0:", "rank 1:", "nothing was sent", what="shape"))
_mismatch("same-numel-other-shape", lambda: _expect_mismatch(
    lambda: phalanx.allreduce(np.ones((2, 3) if _r() == 0 else (3, 2))), "float64[2, 3]", what="numel"))
_mismatch("dtype-names-both-dtypes", lambda: _expect_mismatch(
    lambda: phalanx.allreduce(np.ones(3, np.float32 if _r() == 0 else np.int32)), "float32[3]", "int32[3]",
    what="dtype"))
_mismatch("op-names-both-ops", lambda: _expect_mismatch(
    lambda: phalanx.allreduce(np.ones(3), op="sum" if _r() == 0 else "max"), "op='sum'", "op='max'",
    what="op"))
_mismatch("root-names-both-roots", lambda: _expect_mismatch(
    lambda: phalanx.broadcast(np.ones(3), root=0 if _r() == 0 else 1), "root=0", "root=1", what="root"))
_mismatch("call-names-both-collectives", lambda: _expect_mismatch(
    lambda: phalanx.allreduce(np.ones(3)) if _r() == 0 else phalanx.broadcast(np.ones(3)),
    "broadcast(", "allreduce(", what="call"))
# rank 1 skips the allreduce: its next call (a barrier) pairs with the others' allreduce
_mismatch("skipped-call-names-where-each-rank-is", lambda: _expect_mismatch(
    lambda: phalanx.barrier() if _r() == 1 else (phalanx.allreduce(np.ones(3)), phalanx.barrier()),
    "barrier(", "same order", "Where each rank is:", "rank 1 at barrier (call #", what="skip"))
_mismatch("nonblocking-mismatch-raises-from-wait", lambda: _expect_mismatch(
    lambda: phalanx.iallreduce(np.ones(2 + _r())).wait(), "phalanx.iallreduce", "float64[3]",
    what="nonblocking"))


def mismatches() -> dict[str, str | None]:
    """Each mismatch raises CollectiveMismatchError on every rank; the world stays usable."""
    return MISMATCHES.run()


CALL_SITE = Behaviours()


@CALL_SITE.behaviour("debug-mode-names-the-call-sites")
def _() -> None:
    x = np.ones(2)
    with raises(phalanx.CollectiveMismatchError, "debug mode did not catch the call-site mismatch") as raised:
        if phalanx.rank() == 0:
            phalanx.allreduce(x)  # first call on rank 0 ...
        else:
            phalanx.allreduce(x)  # ... pairs with a different call site on rank 1
    assert "site differs" in str(raised.value) and "worlds_failures.py:" in str(raised.value), str(raised.value)


def call_site_mismatch() -> dict[str, str | None]:
    """Debug mode: the same collective reached from different lines (calls out of order)."""
    return CALL_SITE.run()


BAD_INPUT = Behaviours()


def _bad(name: str, call, kind: type, fragment: str) -> None:
    """Rank 0 makes a bad call that fails locally before anything is sent (the others do nothing)."""
    def check() -> None:
        if phalanx.rank() != 0:
            return
        with raises(phalanx.PhalanxError, "a bad call was accepted") as raised:
            call(phalanx.size())
        exc = raised.value
        assert isinstance(exc, kind), f"{type(exc).__mro__} is not a {kind}"
        assert fragment in str(exc), f"{fragment!r} not in {exc}"
        assert "phalanx." in str(exc), f"the error does not name the call: {exc}"

    BAD_INPUT.add(name, check)


def _torch_ones(*shape: int):
    import torch

    return torch.ones(*shape)


_bad("root-past-the-last-rank", lambda n: phalanx.broadcast(np.ones(2), root=n), ValueError, "root")
_bad("negative-root", lambda n: phalanx.reduce(np.ones(2), root=-1), ValueError, "root")
_bad("float-root", lambda n: phalanx.gather(np.ones(2), root=1.0), ValueError, "root")
_bad("unknown-op", lambda n: phalanx.allreduce(np.ones(2), op="mean"), ValueError, "unknown op")
_bad("avg-of-ints", lambda n: phalanx.allreduce(np.ones(2, np.int64), op="avg"), TypeError, "avg")
_bad("sum-of-bools", lambda n: phalanx.allreduce(np.ones(2, bool)), TypeError, "bool")
_bad("complex-dtype", lambda n: phalanx.allreduce(np.ones(2, np.complex64)), TypeError, "complex64")
_bad("uint16-dtype", lambda n: phalanx.allreduce(np.ones(2, np.uint16)), TypeError, "uint16")
_bad("strided-array", lambda n: phalanx.allreduce(np.ones((3, 4))[:, ::2]), TypeError, "contiguous")
_bad("transposed-tensor", lambda n: phalanx.allreduce(_torch_ones(3, 4).t()), TypeError, "contiguous")
_bad("list", lambda n: phalanx.allreduce([1.0, 2.0]), TypeError, "list")
_bad("str", lambda n: phalanx.allreduce("3"), TypeError, "str")
_bad("alltoall-of-a-scalar", lambda n: phalanx.alltoall(np.float64(1.0)), TypeError, "equal chunks")
_bad("int-beyond-int64", lambda n: phalanx.allreduce(2**70), TypeError, "int64")
_bad("non-int-step", lambda n: phalanx.allreduce(np.ones(2), step="2"), ValueError, "step")
_bad("reduce-scatter-uneven-chunks",
     lambda n: phalanx.reduce_scatter(np.ones(n * 2 + 1)) if n > 1 else phalanx.alltoall(np.float64(1.0)),
     TypeError, "equal chunks")


@BAD_INPUT.behaviour("nothing-was-sent-by-the-bad-calls")
def _() -> None:
    n = phalanx.size()
    assert phalanx.allreduce(phalanx.rank() + 1) == n * (n + 1) // 2


def bad_input() -> dict[str, str | None]:
    """Rank 0 makes bad calls that fail locally before anything is sent; then all ranks agree."""
    return BAD_INPUT.run()


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

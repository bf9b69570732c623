"""Helpers shared by test bodies (imported by pytest and by every rank; torch is imported lazily)."""

from __future__ import annotations

import contextlib
import functools
import inspect
import re
from collections.abc import Callable, Iterator
from typing import Any

__all__ = ["Raised", "doc_problems", "lose_while_running", "nan_in_backward", "raise_in_backward", "raises",
           "requires_cuda"]  # and requires_hosts, made on first use


class Raised:
    """What :func:`raises` caught: ``value`` is the exception (set when the block has ended)."""

    value: Any


def preload_torch() -> None:
    """Import torch, torch.distributed and phalanx.torch now, when a body module loads (before
    ``phalanx.init``), where torch is installed. A rank importing torch inside a body keeps the others
    waiting in their next collective for the whole import (seconds under load), which the short
    timeouts of the failure tests count: import first, and ``init``'s rendezvous absorbs it."""
    try:
        import torch  # noqa: F401
        import torch.distributed  # noqa: F401

        import phalanx.torch  # noqa: F401
    except ImportError:  # the mpi-only worlds run without torch
        pass


@contextlib.contextmanager
def raises(kind: type[BaseException] | tuple[type[BaseException], ...], otherwise: str,
           match: str | None = None) -> Iterator[Raised]:
    """Check that the block raises ``kind`` (a class or a tuple of them), for rank bodies (no pytest there).

    ``otherwise``: the ``AssertionError``'s message when the block raised nothing; ``match``: a
    regular expression ``re.search`` must find in ``str(exc)``. Another exception propagates
    unchanged. The context object's ``value`` is the exception, for further checks::

        with raises(phalanx.InvalidArgumentError, "root=-1 was accepted", match="root=0") as raised:
            phalanx.broadcast(x, root=-1)
        assert "phalanx.broadcast" in str(raised.value)
    """
    raised = Raised()
    try:
        yield raised
    except kind as exc:
        if match is not None and not re.search(match, str(exc)):
            raise AssertionError(f"{type(exc).__name__} does not match {match!r}: {exc}") from exc
        raised.value = exc
    else:
        raise AssertionError(otherwise)


@functools.cache
def _boom() -> Any:
    import torch

    class Boom(torch.autograd.Function):
        """Identity forward; backward raises the exception given to forward."""

        @staticmethod
        def forward(ctx: Any, x: Any, exc: BaseException) -> Any:
            ctx.exc = exc
            return x.clone()

        @staticmethod
        def backward(ctx: Any, grad: Any) -> Any:
            if ctx.exc is None:  # nan_in_backward: a finite loss whose gradients are NaN
                return grad * float("nan"), None
            raise ctx.exc

    return Boom


def raise_in_backward(x: Any, exc: BaseException) -> Any:
    """``x`` unchanged, through an autograd node whose backward raises ``exc`` (a failure mid-backward)."""
    return _boom().apply(x, exc)


def nan_in_backward(x: Any) -> Any:
    """``x`` unchanged, through an autograd node whose backward makes every gradient below it NaN."""
    return _boom().apply(x, None)


def requires_cuda(gpus: int = 1) -> Any:
    """A pytest mark: skip, saying why, unless at least ``gpus`` CUDA GPUs are visible."""
    import pytest
    import torch

    visible = torch.cuda.device_count() if torch.cuda.is_available() else 0
    return pytest.mark.skipif(visible < gpus, reason=f"needs {gpus} CUDA GPU{'s' * (gpus > 1)}, {visible} visible")


def __getattr__(name: str) -> Any:
    # ``requires_hosts`` is made on first use: ranks import this module and never pay for the probe.
    if name == "requires_hosts":
        return _requires_hosts()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


@functools.cache
def _requires_hosts() -> Any:
    """A pytest mark: skip, saying why, unless this process can build simulated hosts (root, Linux,
    ``ip``/``nsenter``/``unshare``/``tc``, namespaces allowed); the probe runs once per process."""
    import pytest

    from phalanx.testing._netns import why_unavailable

    reason = why_unavailable()
    return pytest.mark.skipif(reason is not None, reason=reason or "")


POINTERS = ("module docstring", "see the docstring", "as for ", "raises as ")  # phrases that send the reader elsewhere


def doc_problems(name: str, obj: Any) -> list[str]:
    """Why ``help(obj)`` does not stand alone: no docstring, no short first line, a pointer elsewhere, or
    an argument of its signature (``__init__``'s for a class; ``*args``/``**kwargs`` by name) not named."""
    doc = inspect.getdoc(obj) or ""
    if not doc:
        return [f"{name}: no docstring"]
    problems = []
    first = doc.splitlines()[0]
    if not first or len(first) > 110:
        problems.append(f"{name}: one line of semantics first, got {first!r}")
    flat = " ".join(doc.lower().split())
    problems += [f"{name} points elsewhere: {p!r}" for p in POINTERS if p in flat]
    target = obj.__init__ if inspect.isclass(obj) else obj
    # a class with a built-in __init__ (most exceptions) or a Protocol (made by no one) has nothing to name
    if inspect.isfunction(target) and not getattr(obj, "_is_protocol", False):
        params = [p for p in inspect.signature(target).parameters if p != "self"]
        missing = [p for p in params if p not in doc]
        if missing:
            problems.append(f"{name}: arguments not described: {missing}")
    return problems


def lose_while_running(proc: Any, ready: Callable[[], bool], never: str, lose: Callable[[], None],
                       wait_s: float, end_s: float) -> tuple[str, float]:
    """Once ``ready()`` (within ``wait_s`` s, while the job ``proc`` runs; else fail saying it ``never``
    got there), call ``lose()`` (a host cut, killed...), then wait up to ``end_s`` s for the job's end.
    Returns its output and the ``time.monotonic()`` of the loss; a job still running then is killed."""
    import time

    try:
        deadline = time.monotonic() + wait_s
        while not ready():
            assert proc.poll() is None and time.monotonic() < deadline, never
            time.sleep(0.1)
        lost_at = time.monotonic()
        lose()
        out, _ = proc.communicate(timeout=end_s)
    finally:
        if proc.poll() is None:
            proc.kill()
            out, _ = proc.communicate()
    return out, lost_at

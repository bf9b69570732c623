"""Devices for in-process replicas, and :func:`withdevices`: one thread per replica.

::

    results = phalanx.torch.withdevices(lambda i, device: work(i, device), replicas)  # or 2, or ["cuda:0", ...]

The threads carry the caller's torch thread-local state (grad mode, inference
mode, autocast) and, on a GPU, its device.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import numpy as np
import torch

from .._devices import cuda_count, parse_device
from .._errors import InvalidArgumentError

__all__ = ["resolve_devices", "withdevices"]

T = TypeVar("T")


# -- devices -------------------------------------------------------------------------------------

def resolve_devices(call: str, devices: Any) -> list[torch.device]:
    """``devices`` as a list of torch.device: None (every GPU), an int k, or a list of devices."""
    gpus = cuda_count()
    if devices is None:
        if gpus == 0:
            raise InvalidArgumentError(
                f"phalanx.torch.{call}(devices=None): None means every visible GPU, and there is none "
                "here. Pass an int for that many CPU replicas, e.g. `phalanx.torch.replicate(model, 2)`.")
        return [torch.device("cuda", i) for i in range(gpus)]
    if isinstance(devices, bool) or isinstance(devices, (str, torch.device)):
        raise InvalidArgumentError(
            f"phalanx.torch.{call}(devices={devices!r}): pass a list of devices, e.g. "
            "`['cuda:0', 'cuda:1']` or `['cpu', 'cpu']`, or an int k.")
    if isinstance(devices, (int, np.integer)):
        return _first(call, int(devices), gpus)
    try:
        items = list(devices)
    except TypeError:
        raise InvalidArgumentError(
            f"phalanx.torch.{call}(devices={devices!r}): pass a list of devices, an int k or None "
            "(every visible GPU).") from None
    if not items:
        raise InvalidArgumentError(f"phalanx.torch.{call}(devices=[]): pass at least one device.")
    return [parse_device(f"torch.{call}", d, gpus) for d in items]


def _first(call: str, k: int, gpus: int) -> list[torch.device]:
    """``devices=k``: the first k GPUs, or k CPU replicas on a machine without GPU."""
    if k < 1:
        raise InvalidArgumentError(
            f"phalanx.torch.{call}(devices={k}): the number of replicas must be at least 1.")
    if gpus == 0:
        return [torch.device("cpu")] * k
    if k > gpus:
        raise InvalidArgumentError(
            f"phalanx.torch.{call}(devices={k}): asked for the first {k} GPUs, but {gpus} "
            f"{'is' if gpus == 1 else 'are'} visible. Pass at most {gpus}, or a list of devices "
            "(e.g. `['cpu'] * k` for CPU replicas).")
    return [torch.device("cuda", i) for i in range(k)]


# -- withdevices ---------------------------------------------------------------------------------

def withdevices(fn: Callable[[int, torch.device], T],
                replicas: Any) -> list[T]:
    """``[fn(i, device) for each replica]``, run concurrently, one thread per replica.

    ::

        losses = phalanx.torch.withdevices(lambda i, device: step(replicas[i], chunks[i]), replicas)

    In each thread the current CUDA device is ``device`` (for a GPU), and grad
    mode, inference mode and autocast are the caller's (torch keeps them per
    thread). torch releases the GIL inside its operators, so CPU replicas
    compute on several cores at once (give each its share, e.g.
    ``torch.set_num_threads(cores // k)``).

    Arguments:
        fn: called as ``fn(i, device)`` for replica ``i``.
        replicas: a :class:`Replicas`, a list of devices, or an int k (k GPUs,
            or k CPU threads without a GPU, as :func:`replicate` makes).

    Returns:
        The results of ``fn``, in replica order.

    Raises:
        InvalidArgumentError: ``replicas`` names no usable device.
        Whatever ``fn`` raised: every thread is waited for, then the first
        exception to occur is raised, with a note naming its replica and device.
    """
    if isinstance(replicas, (int, list, tuple)) or not hasattr(replicas, "devices"):
        devices = resolve_devices("withdevices", replicas)
    else:  # a Replicas
        devices = list(replicas.devices)
    state = _ThreadState.capture()
    if len(devices) == 1:
        return [_call(fn, 0, devices[0], state)]
    failures: list[BaseException] = []
    lock = threading.Lock()

    def run(i: int) -> Any:
        try:
            return _call(fn, i, devices[i], state)
        except BaseException as exc:
            with lock:
                failures.append(exc)
            return None

    with ThreadPoolExecutor(max_workers=len(devices), thread_name_prefix="phalanx-replica") as pool:
        futures = [pool.submit(run, i) for i in range(len(devices))]
        results = [f.result() for f in futures]
    if failures:
        raise failures[0]
    return results


def _call(fn: Callable[[int, torch.device], T], i: int, device: torch.device, state: _ThreadState) -> T:
    try:
        with state.applied(device):
            return fn(i, device)
    except BaseException as exc:
        if hasattr(exc, "add_note"):
            exc.add_note(f"(in phalanx.torch.withdevices: replica {i}, on {device})")
        raise


class _ThreadState:
    """The caller's thread-local torch state that a replica's thread must share."""

    def __init__(self, grad: bool, inference: bool, autocast: list[tuple[str, torch.dtype]],
                 autocast_cache: bool) -> None:
        self.grad, self.inference = grad, inference
        self.autocast, self.autocast_cache = autocast, autocast_cache

    @classmethod
    def capture(cls) -> _ThreadState:
        kinds = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
        autocast = [(kind, torch.get_autocast_dtype(kind))
                    for kind in kinds if torch.is_autocast_enabled(kind)]
        return cls(torch.is_grad_enabled(), torch.is_inference_mode_enabled(), autocast,
                   torch.is_autocast_cache_enabled())

    @contextlib.contextmanager
    def applied(self, device: torch.device) -> Iterator[None]:
        with contextlib.ExitStack() as stack:
            if device.type == "cuda":
                stack.enter_context(torch.cuda.device(device))
            if self.inference:
                stack.enter_context(torch.inference_mode())
            stack.enter_context(torch.set_grad_enabled(self.grad))
            for kind, dtype in self.autocast:
                stack.enter_context(torch.autocast(kind, dtype=dtype, cache_enabled=self.autocast_cache))
            yield

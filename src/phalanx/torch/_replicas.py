"""In-process replicas: one copy of a model per device, driven by one thread each (:func:`withdevices`).

::

    replicas = phalanx.torch.replicate(model, ["cuda:0", "cuda:1"])  # or 2: two GPUs, or two CPU copies
    opt = torch.optim.AdamW(model.parameters())       # replica 0 *is* model, so opt steps replica 0
    for batch in loader:
        replicas.zero_grad()
        chunks = replicas.scatter(batch)              # chunk i on device i (equal chunks along dim 0)
        phalanx.torch.withdevices(lambda i, device: loss_fn(replicas[i], chunks[i]).backward(), replicas)
        replicas.allreduce_gradients()                # every replica: the mean over replicas (and processes)
        opt.step()
        replicas.synchronize()                        # replica 0's parameters and buffers into the others

The guide is ``docs/training.md`` ("In-process replicas"); the reduction is
in ``_replica_grads.py``.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, TypeVar, cast, overload

import numpy as np
import torch
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from .._errors import InvalidArgumentError
from ._common import GradientOp
from ._replica_grads import check_same_structure, describe, dtype_groups, reduce_replica_gradients, tensors
from ._threads import resolve_devices, withdevices

__all__ = ["Replicas", "replicate", "withdevices"]

T = TypeVar("T")


# -- replicate -----------------------------------------------------------------------------------

def replicate(model: torch.nn.Module, devices: Sequence[torch.device | str | int] | int | None = None
              ) -> Replicas:
    """One replica of ``model`` per device, each to be driven by its own thread; replica 0 is ``model``.

    Arguments:
        model: the module to replicate. It is moved in place to the first
            device (``model.to(...)``), so an optimizer, scheduler or scaler
            built over it keeps working on replica 0; replicas 1.. are deep
            copies moved to their devices, sharing no tensor with ``model``.
        devices: a list (``["cuda:0", "cuda:1"]``, ``["cpu", "cpu"]``), an int
            k (the first k GPUs, or k CPU replicas on a machine without GPU),
            or None (every visible GPU).

    Returns:
        A :class:`Replicas`: reduce their gradients with
        ``replicas.allreduce_gradients()``, then step replica 0 and copy it
        into the others with ``replicas.synchronize()``.

    Raises:
        InvalidArgumentError: ``model`` is not a module or cannot be deep-copied,
            or ``devices`` names no usable device (a GPU where none is visible,
            an index past the last GPU, a device type other than cpu/cuda).
    """
    if not isinstance(model, torch.nn.Module):
        raise InvalidArgumentError(
            f"phalanx.torch.replicate: model is a {type(model).__module__}.{type(model).__qualname__}; "
            "pass a torch.nn.Module.")
    resolved = resolve_devices("replicate", devices)
    model.to(resolved[0])
    modules: list[torch.nn.Module] = [model]
    for device in resolved[1:]:
        try:
            clone = copy.deepcopy(model)
        except Exception as exc:
            raise InvalidArgumentError(
                f"phalanx.torch.replicate: copy.deepcopy(model) failed ({type(exc).__name__}: {exc}). "
                "Replicas are deep copies of the model: make it copyable (e.g. no non-leaf tensors "
                "held as attributes; build such tensors in forward).") from exc
        modules.append(clone.to(device))
    return Replicas(modules, resolved)


# -- Replicas ------------------------------------------------------------------------------------

class Replicas(Sequence[torch.nn.Module]):
    """Replicas of one model, one per device, in one process (made by :func:`replicate`).

    A sequence of modules (``len``, indexing, iteration; ``replicas[0]`` is the
    user's model) with :attr:`devices` and :attr:`count`. One step::

        replicas.zero_grad()
        chunks = replicas.scatter(batch)                          # equal chunks, chunk i on device i
        phalanx.torch.withdevices(forward_backward, replicas)     # fn(i, device) in one thread each
        replicas.allreduce_gradients()                            # the mean over replicas (and ranks)
        opt.step()                                                # an optimizer over replica 0
        replicas.synchronize()                                    # replica 0 into the others

    One optimizer per replica (Conflux.jl's pattern) works too: every replica
    steps on the same averaged gradients and they stay equal (:meth:`in_sync`)
    without :meth:`synchronize`. Under ``phalanx run -n N`` every process
    holds the same number of replicas; start them from rank 0's model with
    ``phalanx.synchronize(replicas[0])`` then ``replicas.synchronize()``, and
    :meth:`allreduce_gradients` also reduces across the processes.

    Arguments (to build by hand; :func:`replicate` is the usual way):
        modules: independent copies of one model (sharing no tensor).
        devices: the device of each module.

    Raises:
        InvalidArgumentError: a count mismatch, or two modules share a tensor.
    """

    def __init__(self, modules: Sequence[torch.nn.Module], devices: Sequence[torch.device]) -> None:
        if len(modules) != len(devices) or not modules:
            raise InvalidArgumentError(
                f"phalanx.torch.Replicas: got {len(modules)} modules and {len(devices)} devices; "
                "pass one device per module (or use phalanx.torch.replicate(model, devices)).")
        owner: dict[int, int] = {}
        for i, m in enumerate(modules):
            for name, t in tensors(m, True):
                j = owner.setdefault(id(t), i)
                if j != i:
                    raise InvalidArgumentError(
                        f"phalanx.torch.Replicas: replicas {j} and {i} share {name}; replicas must be "
                        "independent copies. Make them with phalanx.torch.replicate(model, devices).")
        self._modules = list(modules)
        self._devices = [torch.device(d) for d in devices]
        self._checked_world: Any = None  # the world in which the ranks were found to agree

    # sequence protocol
    @overload
    def __getitem__(self, i: int) -> torch.nn.Module: ...

    @overload
    def __getitem__(self, i: slice) -> list[torch.nn.Module]: ...

    def __getitem__(self, i: int | slice) -> torch.nn.Module | list[torch.nn.Module]:
        return self._modules[i]

    def __len__(self) -> int:
        return len(self._modules)

    def __iter__(self) -> Iterator[torch.nn.Module]:
        return iter(self._modules)

    def __repr__(self) -> str:
        return f"Replicas({self.count} on {', '.join(str(d) for d in self._devices)})"

    @property
    def devices(self) -> list[torch.device]:
        """The device of each replica, in replica order."""
        return list(self._devices)

    @property
    def count(self) -> int:  # type: ignore[override]  # Sequence.count(value) is not offered
        """The number of replicas."""
        return len(self._modules)

    # -- gradients ---------------------------------------------------------------------------

    def allreduce_gradients(self, op: GradientOp = "avg", *, across_processes: bool = True) -> None:
        """Reduce the gradients of all replicas in place; afterwards every replica holds the same.

        Arguments:
            op: ``"avg"`` (default): each ``.grad`` becomes the mean over the
                replicas; ``"sum"``: the sum.
            across_processes: in a world of several processes (default True),
                also reduce across them, so the result is the mean or sum over
                all ``size() * count`` replicas. Collective then: every rank
                must hold the same number of replicas of the same model and
                call this at the same point.

        A gradient that is None on some replicas counts as zeros there (and is
        filled in); None on every replica stays None. Per dtype, the gradients
        are flattened into one buffer per replica, reduced on replica 0's
        device (NCCL among distinct GPUs) and copied back.

        Raises:
            InvalidArgumentError: ``op`` is neither, or a gradient is sparse.
            CollectiveMismatchError: the replicas no longer have the same
                trainable parameters, or the ranks hold different numbers of
                replicas or different models (on every rank alike); nothing
                is changed.
        """
        self._checked_world = reduce_replica_gradients(self._modules, op, across_processes=across_processes,
                                                       checked_world=self._checked_world)

    # -- parameters and buffers --------------------------------------------------------------

    def synchronize(self, *, buffers: bool = True) -> None:
        """Copy replica 0's parameters (and, with ``buffers``, its buffers, e.g. BatchNorm running
        statistics) into every other replica, in place.

        Across processes, first give replica 0 rank 0's values with
        ``phalanx.synchronize(replicas[0])``, then call this.
        """
        call = "torch.Replicas.synchronize"
        named = [tensors(m, buffers) for m in self._modules]
        check_same_structure(call, "parameter or buffer", [describe(items) for items in named])
        sources = [t for _, t in named[0]]
        with torch.no_grad():
            for items in named[1:]:
                targets = [t for _, t in items]
                if not targets:
                    continue
                if all(t.device == s.device for t, s in zip(targets, sources, strict=True)):
                    torch._foreach_copy_(targets, sources)
                    continue
                # Another device: one transfer per dtype of a flat buffer, not one per tensor.
                for positions in dtype_groups(sources):
                    src = [sources[j] for j in positions]
                    dst = [targets[j] for j in positions]
                    device = dst[0].device
                    moved = _flatten_dense_tensors(src).to(device, non_blocking=device.type == "cuda")
                    torch._foreach_copy_(dst, list(_unflatten_dense_tensors(moved, dst)))

    def zero_grad(self, set_to_none: bool = True) -> None:
        """``zero_grad(set_to_none)`` on every replica."""
        for m in self._modules:
            m.zero_grad(set_to_none=set_to_none)

    def in_sync(self, atol: float = 0.0) -> bool:
        """Whether every replica's parameters and buffers equal replica 0's (within ``atol``)."""
        named = [tensors(m, True) for m in self._modules]
        reference = named[0]
        with torch.no_grad():
            for items in named[1:]:
                if describe(items) != describe(reference):
                    return False
                for (_, a), (_, b) in zip(reference, items, strict=True):
                    b = b.to(a.device)
                    if atol == 0 or not a.is_floating_point():
                        if not torch.equal(a, b):
                            return False
                    elif not torch.allclose(a, b, rtol=0.0, atol=atol):
                        return False
        return True

    # -- data --------------------------------------------------------------------------------

    def scatter(self, batch: Any) -> list[Any]:
        """Split ``batch`` into :attr:`count` equal chunks along dim 0; chunk i goes to device i.

        ``batch``: a tensor, or tuples, lists, dicts (nested) of tensors; each
        chunk has the same structure. Other leaves (None, numbers, strings) are
        given to every chunk unchanged. A batch size that ``count`` does not
        divide is an error: unequal chunks would weight samples unequally
        in the mean over replicas.
        """
        return self._split(batch, "batch")

    def _split(self, x: Any, path: str) -> list[Any]:
        k = self.count
        if isinstance(x, torch.Tensor):
            if x.dim() == 0:
                raise InvalidArgumentError(
                    f"phalanx.torch.Replicas.scatter: {path} is a 0-dimensional tensor, which cannot be "
                    f"split into {k} chunks along dim 0.")
            n = x.shape[0]
            if n == 0 or n % k:
                raise InvalidArgumentError(
                    f"phalanx.torch.Replicas.scatter: {path} has {n} samples along dim 0, which do not "
                    f"split into {k} equal non-empty chunks (unequal chunks would weight samples "
                    f"unequally in the mean). Use a batch size divisible by {k}, e.g. drop the last "
                    "incomplete batch (DataLoader(..., drop_last=True)).")
            return [chunk.to(device, non_blocking=device.type == "cuda")
                    for chunk, device in zip(x.split(n // k), self._devices, strict=True)]
        if isinstance(x, np.ndarray):
            raise InvalidArgumentError(
                f"phalanx.torch.Replicas.scatter: {path} is a NumPy array; pass tensors "
                "(torch.from_numpy(a)).")
        if isinstance(x, Mapping):
            parts = {key: self._split(value, f"{path}[{key!r}]") for key, value in x.items()}
            return [_same_mapping(x, {key: value[i] for key, value in parts.items()}) for i in range(k)]
        if isinstance(x, (tuple, list)):
            columns = [self._split(value, f"{path}[{j}]") for j, value in enumerate(x)]
            rows = [[column[i] for column in columns] for i in range(k)]
            if isinstance(x, tuple) and hasattr(x, "_fields"):
                return [type(x)(*row) for row in rows]
            return [type(x)(row) for row in rows]
        return [x] * k


def _same_mapping(original: Mapping[Any, Any], items: dict[Any, Any]) -> Any:
    if type(original) is dict:
        return items
    try:
        return cast(Any, type(original))(items)
    except TypeError:
        return items

"""In-process replicas: one copy of a model per device, driven by one thread each.

::

    replicas = phalanx.torch.replicate(model, ["cuda:0", "cuda:1"])  # or 2: two GPUs, or two CPU copies
    opt = torch.optim.AdamW(model.parameters())       # replica 0 *is* model, so opt steps replica 0

    def forward_backward(i, device):                 # runs in replica i's thread, on its device
        x, y = chunks[i]
        loss = loss_fn(replicas[i](x), y)
        loss.backward()
        return loss.item()

    for batch in loader:
        replicas.zero_grad()
        chunks = replicas.scatter(batch)              # chunk i on device i (equal chunks along dim 0)
        losses = phalanx.torch.withdevices(forward_backward, replicas)
        replicas.allreduce_gradients()                # every replica: the mean over replicas (and processes)
        opt.step()
        replicas.synchronize()                        # replica 0's parameters and buffers into the others

Conflux.jl's pattern works too: one optimizer per replica
(``opts = [torch.optim.SGD(r.parameters(), lr=0.1) for r in replicas]``), every
replica steps on the same averaged gradients, and the replicas stay equal
(``replicas.in_sync()``) without :meth:`Replicas.synchronize`.

**Threads.** torch operators release the GIL while they compute, so the
threads of :func:`withdevices` run in parallel: on several GPUs, and on several
CPU cores for CPU replicas (give each its share, e.g.
``torch.set_num_threads(cores // k)``). Grad mode, inference mode and autocast
are per thread in torch; ``withdevices`` carries the caller's into each thread.

**Over processes too.** Under ``phalanx run -n N`` every process holds the
same number k of replicas; start them from rank 0's model with
``phalanx.synchronize(replicas[0])`` and then ``replicas.synchronize()``.
:meth:`Replicas.allreduce_gradients` then also reduces across the processes,
so each of the N*k replicas holds the mean over all of them.

Unlike Conflux.jl, replica 0 never aliases another replica (the others are
deep copies), the replicas' structure is checked before every reduction (a
difference is an error naming it, never a silent truncation), and the threads
write no shared state.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, TypeVar, overload

import numpy as np
import torch
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors
from torch.cuda import nccl

from .. import _world
from .._collectives import allreduce
from .._errors import CollectiveMismatchError, InvalidArgumentError
from ._common import verify_same_structure
from ._threads import resolve_devices, withdevices

__all__ = ["Replicas", "replicate", "withdevices"]

T = TypeVar("T")


# -- replicate -----------------------------------------------------------------------------------

def replicate(model: torch.nn.Module, devices: Sequence[torch.device | str | int] | int | None = None
              ) -> Replicas:
    """One replica of ``model`` per device; replica 0 is ``model`` itself.

    ``devices``: a list (``["cuda:0", "cuda:1"]``, ``["cpu", "cpu"]``), an
    int k (the first k GPUs, or k CPU replicas on a machine without GPU), or
    None (every visible GPU). ``model`` is moved in place to ``devices[0]``
    (``model.to(...)``), so an optimizer, scheduler or scaler built over it
    keeps working on replica 0; replicas 1.. are deep copies moved to their
    devices, sharing no tensor with ``model``.
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
    """Replicas of one model on devices, made by :func:`replicate` (see the module docstring).

    A sequence of modules (``len``, indexing, iteration) with ``.devices`` and
    ``.count``; :meth:`allreduce_gradients`, :meth:`synchronize`,
    :meth:`zero_grad`, :meth:`scatter` and :meth:`in_sync` act on all of them.
    """

    def __init__(self, modules: Sequence[torch.nn.Module], devices: Sequence[torch.device]) -> None:
        if len(modules) != len(devices) or not modules:
            raise InvalidArgumentError(
                f"phalanx.torch.Replicas: got {len(modules)} modules and {len(devices)} devices; "
                "pass one device per module (or use phalanx.torch.replicate(model, devices)).")
        owner: dict[int, int] = {}
        for i, m in enumerate(modules):
            for name, t in _tensors(m, True):
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
    def count(self) -> int:
        """The number of replicas."""
        return len(self._modules)

    # -- gradients ---------------------------------------------------------------------------

    def allreduce_gradients(self, op: str = "avg", *, across_processes: bool = True) -> None:
        """Reduce the gradients of all replicas in place; afterwards every replica holds the same.

        For each trainable parameter (``parameters()`` order), ``.grad`` becomes
        the mean (``op="avg"``) or sum (``op="sum"``) over the replicas. A
        gradient that is None on some replicas counts as zeros there (and is
        filled in); None on every replica stays None. With
        ``across_processes`` (default) and a world of several processes, the
        reduction also spans the processes (every rank must hold the same
        number of replicas and call this at the same point), so the result is
        the mean or sum over all ``size() * count`` replicas.

        The gradients are flattened into one buffer per replica and dtype,
        reduced on replica 0's device (NCCL among distinct GPUs) and copied back.
        """
        call = "torch.Replicas.allreduce_gradients"
        if op not in ("avg", "sum"):
            raise InvalidArgumentError(
                f"phalanx.{call}(op={op!r}): use op='avg' (the mean over replicas, the default) or "
                "op='sum'.")
        per_replica = [[p for p in m.parameters() if p.requires_grad] for m in self._modules]
        _check_same_structure(call, "trainable parameter",
                              [_describe(m.named_parameters(), trainable=True) for m in self._modules])
        world = _world.current_or_none() if across_processes else None
        if world is not None and world.size == 1:
            world = None
        if world is not None and self._checked_world is not world:
            self._check_processes(call, _describe(self._modules[0].named_parameters(), trainable=True))
            self._checked_world = world
        if self.count == 1 and world is None:
            return
        with torch.no_grad():
            for positions in _dtype_groups(per_replica[0]):
                self._reduce_group(call, op, [[params[j] for j in positions] for params in per_replica],
                                   world is not None)

    def _check_processes(self, call: str, entries: list[tuple[str, tuple[int, ...], str]]) -> None:
        """Once per world: every rank holds the same number of replicas of the same model."""
        k = self.count
        agreed = allreduce(np.array([k, -k], np.int64), op="max")
        if int(agreed[0]) != k or int(agreed[1]) != -k:
            raise CollectiveMismatchError(
                f"phalanx.{call}: the processes hold different numbers of replicas (this rank, "
                f"{_world.rank()}, holds {k}; the ranks hold between {-int(agreed[1])} and "
                f"{int(agreed[0])}), so the mean over processes would weight replicas unequally; nothing "
                "was reduced. Make the same number of replicas on every rank, e.g. "
                "`phalanx.torch.replicate(model, 2)` everywhere.")
        verify_same_structure(call, [f"{name} {dtype}{list(shape)}" for name, shape, dtype in entries])

    def _reduce_group(self, call: str, op: str, params: list[list[torch.Tensor]], across: bool) -> None:
        """Reduce one dtype's gradients: ``params[i]`` are replica i's parameters of that dtype."""
        dtype = params[0][0].dtype
        flats = []
        missing = False
        for members in params:
            grads = []
            for p in members:
                g = p.grad
                if g is None:
                    missing = True
                    g = torch.zeros_like(p, memory_format=torch.contiguous_format)
                elif g.is_sparse:
                    raise InvalidArgumentError(
                        f"phalanx.{call}: a parameter of shape {list(p.shape)} has a sparse gradient; "
                        "replicas reduce dense gradients (e.g. nn.Embedding(..., sparse=False)).")
                grads.append(g if g.dtype == dtype else g.to(dtype))
            # One presence slot per parameter: after the reduction, 0 where no replica had a gradient.
            presence = torch.tensor([float(p.grad is not None) for p in members], dtype=dtype,
                                    device=members[0].device)
            flats.append(_flatten_dense_tensors([*grads, presence]))
        results = self._reduce_flat(op, flats, across)
        numel = sum(p.numel() for p in params[0])
        seen = results[0][numel:].tolist() if missing else None
        for members, flat in zip(params, results, strict=True):
            views = _unflatten_dense_tensors(flat[:numel], members)
            targets, sources = [], []
            for j, (p, view) in enumerate(zip(members, views, strict=True)):
                if p.grad is not None:
                    targets.append(p.grad)
                    sources.append(view)
                elif seen is not None and seen[j] > 0:
                    p.grad = view.clone()
            if targets:
                torch._foreach_copy_(targets, sources)

    def _reduce_flat(self, op: str, flats: list[torch.Tensor], across: bool) -> list[torch.Tensor]:
        """The reduced buffer, on each replica's device."""
        k = len(flats)
        if k > 1 and _nccl_usable(flats):
            if across:
                nccl.reduce(flats, root=0)
                if op == "avg":
                    flats[0].div_(k)
                result = allreduce(flats[0], op=op)
                if result is not flats[0]:
                    flats[0].copy_(result)
                nccl.broadcast(flats, root=0)
            else:
                nccl.all_reduce(flats)
                if op == "avg":
                    for flat in flats:
                        flat.div_(k)
            return flats
        home = flats[0].device
        total = flats[0]
        for flat in flats[1:]:
            # non_blocking only towards a GPU: an asynchronous copy into host memory may be read early.
            total.add_(flat.to(home, non_blocking=home.type == "cuda"))
        if op == "avg" and k > 1:
            total.div_(k)
        if across:
            result = allreduce(total, op=op)
            if result is not total:
                total.copy_(result)
        return [total if flat.device == home else total.to(flat.device, non_blocking=flat.is_cuda)
                for flat in flats]

    # -- parameters and buffers --------------------------------------------------------------

    def synchronize(self, *, buffers: bool = True) -> None:
        """Copy replica 0's parameters (and, with ``buffers``, its buffers, e.g. BatchNorm running
        statistics) into every other replica, in place.

        Across processes, first give replica 0 rank 0's values with
        ``phalanx.synchronize(replicas[0])``, then call this.
        """
        call = "torch.Replicas.synchronize"
        named = [_tensors(m, buffers) for m in self._modules]
        _check_same_structure(call, "parameter or buffer", [_describe(items) for items in named])
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
                for positions in _dtype_groups(sources):
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
        named = [_tensors(m, True) for m in self._modules]
        reference = named[0]
        with torch.no_grad():
            for items in named[1:]:
                if _describe(items) != _describe(reference):
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
        return type(original)(items)
    except TypeError:
        return items


# -- structure checks ----------------------------------------------------------------------------

def _tensors(module: torch.nn.Module, buffers: bool) -> list[tuple[str, torch.Tensor]]:
    items = [(f"parameter {name}", p) for name, p in module.named_parameters()]
    if buffers:
        items += [(f"buffer {name}", b) for name, b in module.named_buffers()]
    return items


def _describe(items: Any, trainable: bool = False) -> list[tuple[str, tuple[int, ...], str]]:
    return [(name, tuple(t.shape), str(t.dtype).removeprefix("torch."))
            for name, t in items if not trainable or t.requires_grad]


def _check_same_structure(call: str, what: str, described: list[list[tuple[str, tuple[int, ...], str]]]
                          ) -> None:
    """Every replica has replica 0's list of (shape, dtype); else an error naming the first difference."""
    reference = described[0]
    for i, entries in enumerate(described[1:], start=1):
        if [e[1:] for e in entries] == [e[1:] for e in reference]:
            continue
        j = next((j for j, (a, b) in enumerate(zip(reference, entries, strict=False)) if a[1:] != b[1:]),
                 min(len(reference), len(entries)))
        raise CollectiveMismatchError(
            f"phalanx.{call}: replica {i} no longer has the same {what}s as replica 0 "
            f"({len(entries)} against {len(reference)}), so they cannot be matched up; nothing was changed. "
            f"The first difference is {what} #{j}:\n  replica 0: {_show(reference, j)}\n"
            f"  replica {i}: {_show(entries, j)}\n"
            "Change every replica the same way (e.g. freeze a parameter on all of them), or make new "
            "replicas with phalanx.torch.replicate(model, devices).")


def _show(entries: list[tuple[str, tuple[int, ...], str]], j: int) -> str:
    if j >= len(entries):
        return f"none (it has only {len(entries)})"
    name, shape, dtype = entries[j]
    return f"{name}: {dtype}{list(shape)}"


def _dtype_groups(tensors: list[torch.Tensor]) -> list[list[int]]:
    """Positions of ``tensors`` grouped by dtype, groups in order of first appearance."""
    groups: dict[torch.dtype, list[int]] = {}
    for j, t in enumerate(tensors):
        groups.setdefault(t.dtype, []).append(j)
    return list(groups.values())


def _nccl_usable(flats: list[torch.Tensor]) -> bool:
    """NCCL reduces in place among buffers on distinct GPUs of this process."""
    if not all(f.is_cuda for f in flats) or not hasattr(torch._C, "_nccl_all_reduce"):
        return False
    return nccl.is_available(flats)

"""``phalanx.allreduce_gradients``: reduce gradients in a hand-written training loop.

::

    loss.backward()
    phalanx.allreduce_gradients(model)              # every p.grad: the mean over ranks
    opt.step()

    grads = phalanx.allreduce_gradients([gw, gb])   # NumPy arrays or tensors, in place
    grads = phalanx.allreduce_gradients({"w": gw})  # or a dict of them

One fused allreduce per dtype (and device): the gradients are flattened into
one buffer, reduced, and copied back in place. ``op="avg"`` (default) is the
mean over ranks, ``op="sum"`` the sum (FluxMPI's convention).

For a ``torch.nn.Module``, the gradients of its trainable parameters are
reduced; a parameter without a gradient on this rank contributes zeros, and
gets the reduced gradient if any rank had one (if none had, it keeps
``grad=None``, as in single-process torch). Every rank must pass the same
structure (the per-call check of the allreduce catches a different total
size or dtype).

This is the simple, blocking form; :class:`phalanx.torch.DistributedOptimizer`
and :class:`phalanx.torch.DataParallel` overlap the reduction with backward.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from typing import Any

import numpy as np

from ._arrays import UnsupportedArgumentError
from ._collectives import allreduce
from ._errors import InvalidArgumentError
from ._groups import Group
from .comm import GradientOp

__all__ = ["allreduce_gradients", "check_gradient_op", "has_jax_leaves", "pack_gradients", "unpack_gradients"]


def check_gradient_op(call: str, op: Any, over: str = "ranks") -> None:
    """Raise InvalidArgumentError naming ``call`` unless ``op`` is ``"avg"`` or ``"sum"``, how gradients
    combine (``over``: what the mean is over, as the message says)."""
    if op not in ("avg", "sum"):
        raise InvalidArgumentError(f"phalanx.{call}(op={op!r}): use op='avg' (the mean over {over}, the "
                                   "default) or op='sum'.")


def has_jax_leaves(tree: Any) -> bool:
    """Whether jax is loaded and ``tree`` is, or holds, a JAX array."""
    jax = sys.modules.get("jax")
    if jax is None:
        return False
    return any(isinstance(x, jax.Array) for x in jax.tree_util.tree_leaves(tree))


def allreduce_gradients(model_or_grads: Any, op: GradientOp = "avg", *, group: Group | None = None) -> Any:
    """Average (or sum) gradients across ranks in place, and return what was passed.

    ::

        loss.backward()
        phalanx.allreduce_gradients(model)              # every p.grad: the mean over ranks
        opt.step()
        grads = phalanx.allreduce_gradients([gw, gb])   # NumPy arrays or tensors, in place

    Arguments:
        model_or_grads: a ``torch.nn.Module`` (the gradients of its trainable
            parameters: a parameter without a gradient on this rank contributes
            zeros and gets the reduced gradient if any rank had one), or a list or
            dict of NumPy arrays / torch tensors (writable, reduced in place), or a
            JAX pytree (JAX arrays are immutable: a new pytree is returned, its
            non-array leaves left alone). Every rank must pass the same structure,
            shapes and dtypes.
        op: ``"avg"`` (default: the mean over ranks) or ``"sum"``.
        group: a :class:`phalanx.Group`: reduce over its members only (the mean over
            the group); None (default) is the whole world.

    One fused allreduce per dtype and device. This is the simple, blocking form;
    ``phalanx.torch.DistributedOptimizer`` and ``DataParallel`` overlap the
    reduction with backward.

    Returns the module, the list, or the dict that was passed (a new pytree for
    JAX gradients; inside ``jax.jit`` use ``phalanx.jax.allreduce_gradients``). Raises
    InvalidArgumentError (another op), UnsupportedArgumentError (a single array,
    a read-only array, or a leaf that is not an array or tensor), and what
    :func:`phalanx.allreduce` raises (CollectiveMismatchError when ranks pass
    different structures, CollectiveTimeoutError, RankFailedError).
    """
    check_gradient_op("allreduce_gradients", op)
    torch: Any = sys.modules.get("torch")  # loaded iff the arguments can hold tensors
    if torch is not None and isinstance(model_or_grads, torch.nn.Module):
        _reduce_module(torch, model_or_grads, op, group)
        return model_or_grads
    if has_jax_leaves(model_or_grads):  # JAX pytrees: new arrays back
        from .jax._pytrees import reduce_jax_tree  # jax is loaded: the pytree holds its arrays

        return reduce_jax_tree(model_or_grads, op, group)
    if isinstance(model_or_grads, (np.ndarray, str, bytes)) or (
            torch is not None and isinstance(model_or_grads, torch.Tensor)):
        raise UnsupportedArgumentError(
            "phalanx.allreduce_gradients: pass a module, or a list or dict of gradients, e.g. "
            "`allreduce_gradients([g])` for a single array (or use phalanx.allreduce(g, op='avg')).")
    values = list(model_or_grads.values() if isinstance(model_or_grads, Mapping) else model_or_grads)
    for i, g in enumerate(values):
        _check_leaf(torch, i, g)
    groups: dict[tuple[Any, ...], list[int]] = {}
    for i, g in enumerate(values):
        key = ("numpy", g.dtype) if isinstance(g, np.ndarray) else ("torch", g.dtype, g.device)
        groups.setdefault(key, []).append(i)
    for key, indices in groups.items():
        items = [values[i] for i in indices]
        if key[0] == "numpy":
            flat = allreduce(np.concatenate([a.ravel() for a in items]), op=op, group=group)
            offset = 0
            for a in items:
                np.copyto(a, flat[offset:offset + a.size].reshape(a.shape))
                offset += a.size
        else:
            with torch.no_grad():
                flat = allreduce(torch.cat([t.reshape(-1) for t in items]), op=op, group=group)
                parts = torch.split(flat, [t.numel() for t in items])
                torch._foreach_copy_(items, [part.view(t.shape) for part, t in zip(parts, items, strict=True)])
    return model_or_grads if isinstance(model_or_grads, Mapping) else values


def _check_leaf(torch: Any, i: int, g: Any) -> None:
    if isinstance(g, np.ndarray):
        if not g.flags.writeable:
            raise UnsupportedArgumentError(
                f"phalanx.allreduce_gradients: gradient #{i} is a read-only array, which cannot be "
                "reduced in place. Pass a writable copy (`np.array(g)`).")
        return
    if torch is not None and isinstance(g, torch.Tensor):
        return
    raise UnsupportedArgumentError(
        f"phalanx.allreduce_gradients: gradient #{i} is a {type(g).__module__}.{type(g).__qualname__}; "
        "pass NumPy arrays or torch tensors (a missing gradient can only be filled in for a module: "
        "pass the module itself).")


def _reduce_module(torch: Any, model: Any, op: GradientOp, group: Group | None = None) -> None:
    params = [p for p in model.parameters() if p.requires_grad]
    groups: dict[tuple[Any, Any], list[Any]] = {}
    for p in params:
        groups.setdefault((p.dtype, p.device), []).append(p)
    with torch.no_grad():
        for (dtype, _device), members in groups.items():
            flat, missing = pack_gradients(torch, "allreduce_gradients", members, dtype)
            allreduce(flat, op=op, group=group)
            unpack_gradients(torch, flat, members, missing)


def pack_gradients(torch: Any, call: str, params: list[Any], dtype: Any) -> tuple[Any, bool]:
    """``params``' gradients in one flat buffer of ``dtype`` on their device, then one presence slot per
    parameter (1 where it has a gradient); and whether one was missing (it counts as zeros).

    Reduced with the gradients, a presence slot stays 0 only where no rank (or
    replica) had that gradient: :func:`unpack_gradients` then leaves it None.
    Raises InvalidArgumentError naming ``call`` for a sparse gradient.
    """
    parts, missing = [], False
    for p in params:
        g = p.grad
        if g is None:
            missing = True
            g = torch.zeros(p.numel(), dtype=dtype, device=p.device)
        elif g.is_sparse:
            raise InvalidArgumentError(
                f"phalanx.{call}: a parameter of shape {list(p.shape)} has a sparse gradient; gradients "
                "are reduced dense (e.g. nn.Embedding(..., sparse=False)).")
        parts.append(g.reshape(-1) if g.dtype == dtype else g.reshape(-1).to(dtype))
    parts.append(torch.tensor([float(p.grad is not None) for p in params], dtype=dtype, device=params[0].device))
    return torch.cat(parts), missing


def unpack_gradients(torch: Any, flat: Any, params: list[Any], missing: bool) -> None:
    """Copy the reduced ``flat`` (of :func:`pack_gradients`) back into ``params``' gradients, in place;
    a parameter without one gets a copy if any rank had it (``missing``: whether one was missing)."""
    numel = sum(p.numel() for p in params)
    seen = flat[numel:].tolist() if missing else None
    views = torch.split(flat[:numel], [p.numel() for p in params])
    targets, sources = [], []
    for j, (p, view) in enumerate(zip(params, views, strict=True)):
        if p.grad is not None:
            targets.append(p.grad)
            sources.append(view.view(p.grad.shape))
        elif seen is not None and seen[j] > 0:
            p.grad = view.view(p.shape).clone()
    if targets:
        torch._foreach_copy_(targets, sources)

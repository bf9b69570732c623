"""A sharded parameter that keeps its shape: :class:`ShardedTensor`, phalanx's counterpart of FSDP2's DTensor.

::

    p = model.module.fc.weight        # under DataParallel(shard="parameters")
    p.shape                           # torch.Size([512, 256]): the parameter's own shape
    p.dim() >= 2                      # True: nanoGPT's decay groups see what one process sees
    phalanx.torch.shard_of(p)         # ShardSpec: its name, unit, owner and this rank's elements
    p.to_local()                      # this rank's elements: a 1-D view of its shard memory
    p.full_tensor()                   # the whole parameter (collective)

A :class:`ShardedTensor` holds only this rank's elements of a parameter,
flattened (``[start, stop)`` of the parameter's ``numel()`` elements; a
rank may hold none), and reports the parameter's shape, dtype and device.
Element-wise operations (everything an element-wise optimizer does:
``add_``, ``lerp_``, ``addcdiv_``, ``zeros_like``, the ``_foreach_``
kernels) run on this rank's elements alone and return sharded results, so a
torch optimizer made on ``model.parameters()`` updates the shards with
their original shapes in its ``param_groups``. Norms (``torch.linalg.vector_norm``,
``torch._foreach_norm``: what ``torch.nn.utils.clip_grad_norm_`` computes)
are global: one allreduce over the owner's ranks. Anything else (a view, a
matrix product, a sum) raises :class:`~phalanx.UsageError` naming the
operation: it would need the other ranks' elements.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch.utils import _pytree as pytree
from torch.utils._foreach_utils import _foreach_supported_types

from .._errors import UsageError

__all__ = ["ShardOwner", "ShardSpec", "ShardedTensor", "land_grad", "shard_of"]

aten = torch.ops.aten


@dataclass(frozen=True, eq=False)
class ShardSpec:
    """What one sharded parameter is, on this rank: which parameter, which unit, which elements.

    Arguments:
        name: its first name in the wrapped module (``h.0.attn.weight``).
        shape: the whole parameter's shape.
        unit: the name of the unit that gathers it (``""``: the whole model).
        owner: the sharding engine that holds it (it gathers the whole tensor and combines norms).
        start: the first element of the flattened parameter this rank holds.
        stop: one past the last (``start == stop``: this rank holds none).
        bounds: every rank's ``(start, stop)``, in rank order.

    Raises:
        nothing: it is a record; :func:`shard_of` returns it for a sharded tensor.
    """

    name: str
    shape: torch.Size
    unit: str
    owner: Any
    start: int
    stop: int
    bounds: tuple[tuple[int, int], ...]

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


class ShardedTensor(torch.Tensor):
    """This rank's elements of a tensor shaped like a parameter: a sharded parameter, its gradient or
    its optimizer state.

    ``shape``, ``dtype`` and ``device`` are the whole parameter's; :meth:`to_local` is this rank's
    elements of it, flattened; :meth:`full_tensor` the whole tensor (collective). Element-wise
    operations (what element-wise optimizers do, ``zero_``, ``copy_``, ``zeros_like``) act on this
    rank's elements and return sharded results; norms (``torch.linalg.vector_norm``,
    ``torch._foreach_norm``, so ``torch.nn.utils.clip_grad_norm_``) are over every rank's elements
    (collective); any other operation raises :class:`~phalanx.UsageError` naming it.

    Arguments:
        local: this rank's elements (1-D, ``spec.stop - spec.start`` of them).
        spec: the :class:`ShardSpec` saying which parameter and which elements.
        requires_grad: whether it is a trainable parameter.

    Raises:
        UsageError: an operation that needs the other ranks' elements (a view, a matrix product, a sum),
            naming the operation and the parameter.
    """

    _local: torch.Tensor
    _spec: ShardSpec
    __torch_function__ = torch._C._disabled_torch_function_impl  # type: ignore[assignment]

    @staticmethod
    def __new__(cls, local: torch.Tensor, spec: ShardSpec, requires_grad: bool = False) -> ShardedTensor:
        t = torch.Tensor._make_wrapper_subclass(cls, spec.shape, dtype=local.dtype, device=local.device,
                                                requires_grad=requires_grad)
        t._local, t._spec = local, spec
        return t

    def __repr__(self) -> str:  # type: ignore[override]
        s = self._spec
        return (f"ShardedTensor({s.name!r}, shape={list(s.shape)}, dtype={self.dtype}, elements "
                f"[{s.start}, {s.stop}) of {s.numel} on this rank)")

    def to_local(self) -> torch.Tensor:
        """This rank's elements, flattened (a view: writing it writes the shard)."""
        return self._local

    def full_tensor(self) -> torch.Tensor:
        """The whole tensor, every rank's elements in place (collective: every rank of the owner calls it)."""
        return self._spec.owner.full_tensor(self)

    def __reduce_ex__(self, protocol: Any) -> Any:
        raise UsageError(
            f"pickling (torch.save) {self!r}: a sharded tensor is one rank's part, tied to its world. Save "
            "the wrapper's `model.state_dict()` and the optimizer's `optimizer.state_dict()` (whole tensors, "
            "collective: call them on every rank, save on one), `t.full_tensor()`, or "
            "`phalanx.torch.save_sharded(path, model, optimizer)` (each rank its own part).")

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:  # type: ignore[override]
        kwargs = kwargs or {}
        handler = _HANDLERS.get(func)
        if handler is not None:
            return handler(*args, **kwargs)
        name = func._schema.name
        if torch.Tag.pointwise in func.tags or name.startswith(("aten::_foreach_", "aten::_amp_foreach_")) \
                or func in _LIKE:
            return _elementwise(func, args, kwargs)
        raise UsageError(_refusal(name, args))


class ShardOwner:
    """What a :class:`ShardedTensor` asks of the engine that holds it (``spec.owner``): the whole tensor and
    norms over every rank's elements. An owner has ``world`` (its ranks) and ``group`` (the
    :class:`phalanx.Group` or None for the whole world)."""

    world: Any
    group: Any
    private_storage = False  # True: a local's storage holds only this rank's elements (saved without a copy)

    def allreduce_norms(self, part: torch.Tensor, op: Literal["sum", "max"]) -> torch.Tensor:
        """``part`` (this rank's contributions to some norms) combined over the ranks (collective)."""
        from .._collectives import allreduce

        return allreduce(part, op=op, group=self.group) if self.world.size > 1 else part

    @torch.no_grad()
    def full_tensor(self, t: ShardedTensor) -> torch.Tensor:
        """The whole tensor from every rank's elements (collective, in the same order on every rank)."""
        from .._collectives import allgather

        spec, local = t._spec, t._local
        lengths = [b - a for a, b in spec.bounds]
        if self.world.size == 1:
            return local.clone().view(spec.shape)
        row = torch.zeros(max(lengths), dtype=local.dtype, device=local.device)
        row[:local.numel()] = local
        rows = allgather(row, group=self.group)
        return torch.cat([rows[r, :n] for r, n in enumerate(lengths)]).view(spec.shape)


def land_grad(shard: ShardedTensor, part: torch.Tensor) -> ShardedTensor:
    """This rank's reduced elements ``part`` of ``shard``'s gradient, landed in ``shard.grad``: added to
    the gradient it holds (a second backward before the step, as torch adds into ``p.grad``), else
    held as its gradient (a view of ``part``, no copy). The one rule for every sharded level; returns
    ``shard.grad``."""
    grad = shard.grad
    if isinstance(grad, ShardedTensor):
        grad._local.add_(part)
        return grad
    landed = ShardedTensor(part, shard._spec)
    shard.grad = landed
    return landed


def shard_of(t: Any) -> ShardSpec | None:
    """The :class:`ShardSpec` of a sharded parameter (or of its gradient or optimizer state): which
    parameter ``t`` is part of, its unit and which elements this rank holds; None for any other tensor.

    Arguments:
        t: any object; a :class:`ShardedTensor` gives its spec.

    Returns:
        the spec, or None.
    """
    return t._spec if isinstance(t, ShardedTensor) else None


# -- element-wise: this rank's elements alone ----------------------------------------
_LIKE = {aten.zeros_like.default, aten.ones_like.default, aten.empty_like.default, aten.full_like.default,
         aten.clone.default, aten._to_copy.default, aten.rand_like.default, aten.randn_like.default}


def _elementwise(func: Any, args: Any, kwargs: Any) -> Any:
    specs: list[ShardSpec] = []
    first_list: list[Any] | None = None

    def unwrap(x: Any) -> Any:
        if isinstance(x, ShardedTensor):
            specs.append(x._spec)
            return x._local
        if isinstance(x, torch.Tensor) and x.dim() > 0:
            raise UsageError(
                f"phalanx: {func._schema.name} combines a sharded parameter (this rank holds some of its "
                f"elements) with a whole tensor of shape {list(x.shape)}. Take the whole value with "
                "`p.full_tensor()` (collective), or this rank's elements of the other tensor with "
                "`phalanx.torch.shard_of(p)`'s start/stop.")
        return x

    for a in args:  # a _foreach_ kernel's results follow its first list
        if isinstance(a, (list, tuple)) and a and any(isinstance(t, ShardedTensor) for t in a):
            first_list = list(a)
            break
    out = func(*pytree.tree_map(unwrap, args), **pytree.tree_map(unwrap, kwargs))
    if out is None:  # an in-place _foreach_ kernel
        return None
    if _mutates_first(func):
        return args[0]
    if isinstance(out, (list, tuple)) and first_list is not None:
        return [_wrap_like(o, t) for o, t in zip(out, first_list, strict=True)]
    return ShardedTensor(out, specs[0]) if isinstance(out, torch.Tensor) else out


def _wrap_like(out: torch.Tensor, like: Any) -> Any:
    return ShardedTensor(out, like._spec) if isinstance(like, ShardedTensor) else out


def _mutates_first(func: Any) -> bool:
    args = func._schema.arguments
    return bool(args) and args[0].alias_info is not None and args[0].alias_info.is_write


# -- the operations with their own rule -------------------------------------------------
def _detach(x: ShardedTensor) -> ShardedTensor:
    return ShardedTensor(x._local.detach(), x._spec)


def _copy_(dst: Any, src: Any, non_blocking: bool = False) -> Any:
    if not isinstance(dst, ShardedTensor):
        raise UsageError(f"phalanx: copying a sharded tensor ({src._spec.name!r}) into a whole one of shape "
                         f"{list(dst.shape)}: take the whole value with `p.full_tensor()` (collective).")
    if isinstance(src, ShardedTensor):
        dst._local.copy_(src._local, non_blocking)
    elif src.dim() == 0:
        dst._local.copy_(src)
    elif src.numel() == dst._spec.numel:  # a whole value (load_state_dict): this rank's elements of it
        s = dst._spec
        dst._local.copy_(src.reshape(-1)[s.start:s.stop], non_blocking)
    else:
        raise UsageError(f"phalanx: copy into the sharded parameter {dst._spec.name!r} (shape "
                         f"{list(dst._spec.shape)}) from a tensor of shape {list(src.shape)}: the shapes differ.")
    return dst


def _inplace(op: str) -> Any:
    def run(x: ShardedTensor, *args: Any, **kwargs: Any) -> ShardedTensor:
        getattr(x._local, op)(*args, **kwargs)
        return x
    return run


def _same_size(a: Any, b: Any) -> bool:
    return bool(a.shape == b.shape)


def _vector_norm(x: ShardedTensor, ord: float = 2, dim: Any = None, keepdim: bool = False,
                 dtype: Any = None) -> torch.Tensor:
    if dim not in (None, [], ()):
        raise UsageError(f"phalanx: torch.linalg.vector_norm of the sharded parameter {x._spec.name!r} along "
                         f"dim={dim}: only the norm of all its elements is defined on a shard.")
    (norm,) = _global_norms([x], ord, dtype)
    return norm


def _foreach_norm(tensors: list[Any], ord: float = 2, dtype: Any = None) -> list[torch.Tensor]:
    return _global_norms(list(tensors), ord, dtype)


def _global_norms(tensors: list[Any], ord: float, dtype: Any) -> list[torch.Tensor]:
    """Each tensor's norm over every rank's elements: one allreduce per owner, the same on every rank."""
    ord = float(ord)
    if not (ord > 0):
        raise UsageError(f"phalanx: a norm of order {ord} over sharded tensors: use an order > 0 or inf.")
    out: list[torch.Tensor | None] = [None] * len(tensors)
    by_owner: dict[int, tuple[Any, list[int]]] = {}
    for i, t in enumerate(tensors):
        if isinstance(t, ShardedTensor):
            by_owner.setdefault(id(t._spec.owner), (t._spec.owner, []))[1].append(i)
        else:
            out[i] = torch.linalg.vector_norm(t, ord, dtype=dtype)
    for owner, indices in by_owner.values():
        locals_ = [tensors[i]._local for i in indices]
        device = locals_[0].device
        if math.isinf(ord):
            part = torch.stack([x.abs().max().double() if x.numel() else torch.zeros((), dtype=torch.float64,
                                                                                    device=device)
                                for x in locals_])
            total = owner.allreduce_norms(part, "max")
        else:
            part = torch.stack([x.double().abs().pow(ord).sum() for x in locals_])
            total = owner.allreduce_norms(part, "sum") ** (1.0 / ord)
        for j, i in enumerate(indices):
            out[i] = total[j].to(dtype or tensors[i].dtype)
    return out  # type: ignore[return-value]


def _refusal(name: str, args: Any) -> str:
    shard = next((a for a in pytree.tree_leaves(args) if isinstance(a, ShardedTensor)), None)
    what = f"the sharded parameter {shard._spec.name!r} (shape {list(shard._spec.shape)})" if shard is not None \
        else "a shard"
    return (f"phalanx: {name} on {what}: this rank holds only some of its elements, so only element-wise "
            "operations (what element-wise optimizers do) and norms run on it. Take the whole value with "
            "`p.full_tensor()` (collective: every rank calls it), use the module's parameters inside "
            "forward (they are whole there), or read `model.state_dict()` (whole tensors).")


_HANDLERS: dict[Any, Any] = {
    aten.detach.default: _detach,
    aten.alias.default: _detach,
    aten.copy_.default: _copy_,
    aten.zero_.default: _inplace("zero_"),
    aten.fill_.Scalar: _inplace("fill_"),
    aten.fill_.Tensor: _inplace("fill_"),
    aten.is_same_size.default: _same_size,
    aten.linalg_vector_norm.default: _vector_norm,
    aten._foreach_norm.Scalar: _foreach_norm,
}

# torch's clip_grad_norm_ (and its foreach optimizers on GPUs) take one kernel for a list of these,
# as for DTensor: one collective for all the norms instead of one per parameter.
if ShardedTensor not in _foreach_supported_types:
    _foreach_supported_types.append(ShardedTensor)  # type: ignore[arg-type]  # (mypy: __new__ differs)

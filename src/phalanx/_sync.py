"""``phalanx.synchronize``: every rank ends up holding root's values.

::

    model = phalanx.synchronize(model)           # parameters and buffers, in place
    state = phalanx.synchronize({"model": model, "opt": opt, "sched": sched, "epoch": epoch})
    epoch = state["epoch"]                       # use the return value: scalars come back new

What it synchronizes (a broadcast from ``root``), anywhere in nested dicts,
lists, tuples, namedtuples and dataclasses:

* ``torch.nn.Module``: its parameters and buffers, in place.
* ``torch.optim.Optimizer``: its existing ``state`` (tensors in place, scalars
  written back) and the numeric hyperparameters of its ``param_groups`` (lr,
  betas, ...). Not its parameters (synchronize the model for those), and an
  empty state stays empty: no step is ever taken.
* LR schedulers: through ``state_dict()``/``load_state_dict()``. The
  optimizer's current lr lives in the optimizer: synchronize both.
* Tensors and NumPy arrays (in place; a read-only array gets a new one),
  Python ``bool``/``int``/``float`` and NumPy scalars (new values).
* JAX arrays, inside any JAX pytree (params, optax states, flax ``nnx``
  state, equinox modules): new arrays on the same device, in a new pytree
  (JAX arrays are immutable; GPU arrays are staged through host memory).
* Anything else (str, None, functions, other objects) is left as it is.

Cost: before any data moves, the ranks agree on a hash of the structure
(every leaf's path, kind, dtype, shape and device type): one small allreduce.
If they differ, every rank raises the same :class:`CollectiveMismatchError`
naming the first differing entry, and the world stays usable. The data then
moves as raw bytes: leaves under 1 MiB fused into one buffer per device (and
per 64 MiB), whatever their dtypes, and each larger leaf on its own, straight
into its memory (copying it into a buffer would cost more than the call).
"""

from __future__ import annotations

import sys
from typing import Any

import numpy as np

from ._agreement import agree
from ._arrays import UnsupportedArgumentError, is_jax_array, jax_host_view
from ._collectives import broadcast
from ._errors import InvalidArgumentError
from ._groups import Group, world_for
from ._sync_errors import mismatch_error
from ._tree import Node, flatten, jax_node, unflatten
from ._world import World

__all__ = ["synchronize"]

BUCKET_BYTES = 64 << 20  # a fused buffer's size limit: bounds the extra memory a sync needs
DIRECT_BYTES = 1 << 20  # a leaf this large is broadcast on its own, in place when it is contiguous
_ALIGN = 16  # every leaf starts at a multiple of this in its buffer, so any dtype can view it
_NUMERIC_KINDS = frozenset("biufcmM")  # NumPy dtype kinds that are data (not str/object)
_SCALARS = {bool: ("bool", np.dtype(np.bool_)), int: ("int", np.dtype(np.int64)),
            float: ("float", np.dtype(np.float64))}


class _Leaf:
    """One leaf: where it is, what the ranks compare, and how its bytes move."""

    __slots__ = ("path", "value", "kind", "dtype", "shape", "place", "nbytes", "note")

    def __init__(self, path: str, value: Any, kind: str, dtype: str | None = None,
                 shape: tuple[int, ...] | None = None, place: str | None = None, nbytes: int = 0,
                 note: str = "") -> None:
        self.path = path
        self.value = value
        self.kind = kind  # tensor | ndarray | jax | bool | int | float | npscalar | skip | unsupported
        self.dtype = dtype
        self.shape = shape
        self.place = place  # "host", or a device slot like "cuda#0"
        self.nbytes = nbytes
        self.note = note  # the type name of a skipped leaf, or why a leaf is unsupported

    @property
    def moves(self) -> bool:
        return self.kind not in ("skip", "unsupported")

    def key(self) -> list[Any]:
        shape = list(self.shape) if self.shape is not None else None
        return [self.path, self.kind, self.dtype, shape, self.place]


def synchronize(obj: Any, root: int = 0, *, group: Group | None = None) -> Any:
    """Make every rank hold ``root``'s values of ``obj``; return the synchronized object.

    >>> model = phalanx.synchronize(model)   # parameters and buffers, in place
    >>> state = phalanx.synchronize({"model": model, "opt": opt, "epoch": epoch})

    Arguments:
        obj: what to synchronize, anywhere in nested dicts, lists, tuples,
            namedtuples and dataclasses: ``torch.nn.Module`` (parameters and
            buffers), ``torch.optim.Optimizer`` (its existing ``state`` and the
            numeric hyperparameters of its ``param_groups``; not its parameters:
            synchronize the model too), LR schedulers (through ``state_dict()``),
            tensors and NumPy arrays, Python ``bool``/``int``/``float`` and NumPy
            scalars. Anything else (str, None, functions, other objects) is left
            as it is. The same structure (keys, shapes, dtypes, devices) on every rank.
        root: the rank whose values every rank ends up with, the same on every rank.
        group: a :class:`phalanx.Group`: synchronize among its members only, from
            its group rank ``root``; None (default) is the whole world.

    Returns ``obj`` synchronized: mutable things (tensors, arrays, modules,
    optimizers, dicts, lists, dataclasses) are updated in place and returned;
    Python scalars and tuples come back as new values, so use the return value.
    Collective: every rank must call it. Leaves under 1 MiB travel fused in one
    buffer per device, larger ones on their own, straight into their memory.

    Raises InvalidArgumentError (a ``root`` that is not a rank),
    CollectiveMismatchError (ranks passed different structures: raised on every
    rank, naming the first differing entry, before any data moves; the world stays
    usable), UnsupportedArgumentError (a leaf that cannot be sent, e.g. an object
    array), CollectiveTimeoutError and RankFailedError (a rank never came or died).
    """
    world = world_for(group, "synchronize")
    if not isinstance(root, int) or isinstance(root, bool) or not 0 <= root < world.size:
        raise InvalidArgumentError(f"phalanx.synchronize: root={root!r} is not a rank of this world "
                         f"(ranks 0..{world.size - 1}).")
    pairs, spec = flatten(obj, _expand, "obj")
    leaves = _classify(pairs)
    if world.size > 1:
        _agree(world, leaves, root)
    bad = [leaf for leaf in leaves if leaf.kind == "unsupported"]
    if bad:  # every rank has the same ones (the agreement compared them), so every rank raises
        raise UnsupportedArgumentError(
            "phalanx.synchronize cannot send " + "; ".join(f"{b.path}: {b.note}" for b in bad[:5])
            + (f" (and {len(bad) - 5} more)" if len(bad) > 5 else "") + ".")
    values = [leaf.value for leaf in leaves]
    if world.size > 1:
        for bucket in _buckets(leaves):
            _move(bucket, leaves, values, root, world.rank == root, group)
    return unflatten(spec, values)


# -- what is inside modules, optimizers and schedulers ----------------------------------------

def _expand(x: Any) -> Node | None:
    if "jax" in sys.modules:  # JAX pytree nodes (optax states, nnx state, equinox modules)
        node = jax_node(x)
        if node is not None:
            return node
    torch = sys.modules.get("torch")
    if torch is None:  # nothing can be a torch object
        return None
    if isinstance(x, torch.nn.Module):
        named = list(x.named_parameters()) + list(x.named_buffers())
        return Node([f".{name}" for name, _ in named], [t for _, t in named], lambda _values: x)
    if isinstance(x, torch.optim.Optimizer):
        return _optimizer_node(x)
    schedulers = tuple(c for c in (getattr(torch.optim.lr_scheduler, n, None) for n in
                                   ("LRScheduler", "_LRScheduler", "ReduceLROnPlateau"))
                       if isinstance(c, type))
    if schedulers and isinstance(x, schedulers):
        scheduler: Any = x  # one of torch's scheduler classes, found by name above

        def load(values: list[Any]) -> Any:
            scheduler.load_state_dict(values[0])
            return scheduler
        return Node([".state_dict()"], [scheduler.state_dict()], load)
    return None


def _optimizer_node(opt: Any) -> Node:
    """Paths follow ``opt.state_dict()``: parameters numbered in param_groups order."""
    params = [p for group in opt.param_groups for p in group["params"]]
    index = {id(p): i for i, p in enumerate(params)}
    parts: list[str] = []
    children: list[Any] = []
    for i, p in enumerate(params):
        if p in opt.state:  # `in`, not `[]`: opt.state is a defaultdict, and empty must stay empty
            parts.append(f".state[{i}]")
            children.append(opt.state[p])
    for key, value in opt.state.items():  # state a custom optimizer keeps under its own keys
        if id(key) not in index:
            parts.append(f".state[{key!r}]")
            children.append(value)
    hypers = [{k: v for k, v in group.items() if k != "params"} for group in opt.param_groups]
    parts += [f".param_groups[{j}]" for j in range(len(hypers))]
    children += hypers

    def rebuild(values: list[Any]) -> Any:
        for group, new in zip(opt.param_groups, values[len(values) - len(hypers):], strict=True):
            group.update(new)
        return opt

    return Node(parts, children, rebuild)


# -- leaves -------------------------------------------------------------------------------------

def _classify(pairs: list[tuple[str, Any]]) -> list[_Leaf]:
    torch = sys.modules.get("torch")
    slots: dict[str, str] = {}  # device -> slot: "cuda:1" on this rank may be "cuda:0" on another
    leaves = []
    for path, x in pairs:
        if torch is not None and isinstance(x, torch.Tensor):
            leaves.append(_tensor_leaf(torch, path, x, slots))
        elif is_jax_array(x):
            leaves.append(_jax_leaf(path, x))
        elif isinstance(x, np.ndarray):
            if x.dtype.kind in _NUMERIC_KINDS:
                dtype = x.dtype.name if x.dtype.isnative else x.dtype.str
                leaves.append(_Leaf(path, x, "ndarray", dtype, x.shape, "host", x.nbytes))
            else:
                leaves.append(_Leaf(path, x, "skip", note=f"a NumPy {x.dtype} array"))
        elif type(x) in _SCALARS:
            kind, dtype = _SCALARS[type(x)]
            if kind == "int" and not -(1 << 63) <= x < (1 << 63):
                leaves.append(_Leaf(path, x, "unsupported", "int", note=f"the int {x} does not fit in "
                                    "int64; store it as a float or split it"))
            else:
                leaves.append(_Leaf(path, x, kind, dtype.name, (), "host", dtype.itemsize))
        elif isinstance(x, np.generic) and x.dtype.kind in _NUMERIC_KINDS:
            leaves.append(_Leaf(path, x, "npscalar", x.dtype.str, (), "host", x.dtype.itemsize))
        else:
            leaves.append(_Leaf(path, x, "skip", note=f"a {type(x).__module__}.{type(x).__qualname__}"))
    return leaves


def _tensor_leaf(torch: Any, path: str, t: Any, slots: dict[str, str]) -> _Leaf:
    dtype = str(t.dtype).rpartition(".")[2]
    uninitialized = getattr(torch.nn.parameter, "UninitializedTensorMixin", ())
    if uninitialized and isinstance(t, uninitialized):
        return _Leaf(path, t, "unsupported", "uninitialized",
                     note="an uninitialized parameter of a lazy module; run one forward pass first")
    if t.layout != torch.strided:
        return _Leaf(path, t, "unsupported", str(t.layout),
                     note=f"a {t.layout} tensor; synchronize `x.to_dense()` or its index/value tensors")
    if t.device.type == "meta":
        return _Leaf(path, t, "unsupported", "meta", note="a meta tensor has no data; materialize it first")
    if t.device.type == "cpu":
        place = "host"
    else:
        name = str(t.device)
        if name not in slots:
            slots[name] = f"{t.device.type}#{sum(s.startswith(t.device.type) for s in slots.values())}"
        place = slots[name]
    return _Leaf(path, t, "tensor", dtype, tuple(t.shape), place, t.numel() * t.element_size())


def _jax_leaf(path: str, x: Any) -> _Leaf:
    """A JAX array: moved through host memory (staged for a GPU array), returned as a new array."""
    if isinstance(x, sys.modules["jax"].core.Tracer):
        return _Leaf(path, x, "unsupported", "traced",
                     note="a traced JAX value (inside jax.jit); synchronize outside the jitted function")
    return _Leaf(path, x, "jax", str(x.dtype), tuple(x.shape), "host", int(x.nbytes))


# -- agreement ----------------------------------------------------------------------------------

def _agree(world: World, leaves: list[_Leaf], root: int) -> None:
    """One small allreduce of a hash of the structure; on a difference, every rank raises the same error."""
    tables = agree(world, "synchronize", [root, [leaf.key() for leaf in leaves]],
                   lambda: {"root": root, "entries": [[*leaf.key(), leaf.note] for leaf in leaves]})
    if tables is not None:
        raise mismatch_error(tables)


# -- moving the bytes ---------------------------------------------------------------------------

class _Bucket:
    """One broadcast: leaves packed at byte offsets, or (``direct``) one large leaf sent as it is."""

    __slots__ = ("place", "items", "total", "direct")

    def __init__(self, place: str, direct: bool = False) -> None:
        self.place = place
        self.items: list[tuple[int, int]] = []  # (leaf index, byte offset)
        self.total = 0
        self.direct = direct

    def add(self, i: int, nbytes: int) -> None:
        self.items.append((i, self.total))
        self.total += -(-nbytes // _ALIGN) * _ALIGN


def _buckets(leaves: list[_Leaf]) -> list[_Bucket]:
    """The broadcasts, decided from what the ranks agreed on only, so they match on every rank."""
    buckets: list[_Bucket] = []
    filling: dict[str, _Bucket] = {}  # place -> its bucket being filled
    for i, leaf in enumerate(leaves):
        if not leaf.moves or leaf.nbytes == 0:
            continue
        place = leaf.place or "host"
        if leaf.nbytes >= DIRECT_BYTES:  # copying it into a buffer would cost more than a call
            alone = _Bucket(place, direct=True)
            alone.items.append((i, 0))
            alone.total = leaf.nbytes  # exactly: a rank that copies must match one that sends in place
            buckets.append(alone)
            continue
        bucket = filling.get(place)
        if bucket is None or bucket.total + leaf.nbytes > BUCKET_BYTES:
            bucket = filling[place] = _Bucket(place)
            buckets.append(bucket)
        bucket.add(i, leaf.nbytes)
    return buckets


def _move(bucket: _Bucket, leaves: list[_Leaf], values: list[Any], root: int, is_root: bool,
          group: Group | None = None) -> None:
    if bucket.direct:
        i = bucket.items[0][0]
        view = _byte_view(leaves[i].value)
        if view is not None:  # its own memory: broadcast straight into it
            broadcast(view, root, group=group)
            return
    if bucket.place == "host":
        flat: Any = np.empty(bucket.total, np.uint8)
        if is_root:
            for i, off in bucket.items:
                flat[off:off + leaves[i].nbytes] = _host_bytes(leaves[i].value)
        broadcast(flat, root, group=group)
        if not is_root:
            for i, off in bucket.items:
                values[i] = _host_store(leaves[i], flat[off:off + leaves[i].nbytes])
        return
    torch = sys.modules["torch"]
    device = leaves[bucket.items[0][0]].value.device
    flat = torch.empty(bucket.total, dtype=torch.uint8, device=device)
    with torch.no_grad():
        if is_root:
            for i, off in bucket.items:
                flat[off:off + leaves[i].nbytes].copy_(_tensor_bytes(leaves[i].value))
        broadcast(flat, root, group=group)
        if not is_root:
            for i, off in bucket.items:
                t = leaves[i].value
                t.copy_(flat[off:off + leaves[i].nbytes].view(t.dtype).view(t.shape))


def _byte_view(x: Any) -> Any:
    """A writable uint8 view of all of ``x``'s memory, or None when it has none (a copy is needed)."""
    if is_jax_array(x):  # immutable: root's bytes land in a buffer, then a new array
        return None
    if isinstance(x, np.ndarray):
        return x.reshape(-1).view(np.uint8) if x.flags.c_contiguous and x.flags.writeable else None
    torch = sys.modules["torch"]
    if x.is_contiguous() and not x.is_conj() and not x.is_neg():
        return x.detach().reshape(-1).view(torch.uint8)
    return None


def _tensor_bytes(t: Any) -> Any:
    torch = sys.modules["torch"]
    return t.detach().resolve_conj().resolve_neg().contiguous().reshape(-1).view(torch.uint8)


def _host_bytes(x: Any) -> np.ndarray:
    if isinstance(x, np.ndarray):
        return np.ascontiguousarray(x).reshape(-1).view(np.uint8)
    if type(x) in _SCALARS:
        return np.array([x], _SCALARS[type(x)][1]).view(np.uint8)
    if isinstance(x, np.generic):
        return np.array(x).reshape(-1).view(np.uint8)
    if is_jax_array(x):
        return jax_host_view(x, "synchronize").reshape(-1).view(np.uint8)
    return _tensor_bytes(x).cpu().numpy()


def _host_store(leaf: _Leaf, chunk: np.ndarray) -> Any:
    """Write root's bytes into the leaf (in place where it can be) and return its new value."""
    x, kind = leaf.value, leaf.kind
    if kind == "tensor":
        torch = sys.modules["torch"]
        with torch.no_grad():
            x.copy_(torch.from_numpy(chunk).view(x.dtype).view(x.shape))
        return x
    if kind == "ndarray":
        new = chunk.view(x.dtype).reshape(x.shape)
        if x.flags.writeable:
            x[...] = new
            return x
        return new.copy()  # a read-only array gets a new one, as phalanx.broadcast does
    if kind == "jax":
        device = next(iter(x.sharding.device_set))
        return sys.modules["jax"].device_put(chunk.view(x.dtype).reshape(x.shape).copy(), device)
    if kind == "npscalar":
        return chunk.view(x.dtype)[0]
    if kind == "bool":
        return bool(chunk[0])
    if kind == "int":
        return int(chunk.view(np.int64)[0])
    return float(chunk.view(np.float64)[0])

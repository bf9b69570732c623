"""Flatten nested containers into ``(path, leaf)`` pairs, and put new leaves back.

::

    leaves, spec = flatten({"w": w, "betas": (0.9, 0.999)}, path="obj")
    # leaves == [("obj['betas'][0]", 0.9), ("obj['betas'][1]", 0.999), ("obj['w']", w)]
    same = unflatten(spec, [0.5, 0.5, w])   # the same dict, now with betas == (0.5, 0.5)

Containers are ``dict`` (and subclasses; keys visited in sorted order when
they sort, so ranks that built a dict in a different order still agree),
``list``, ``tuple``, namedtuple and dataclass instances. Everything else is a
leaf, unless the caller's ``expand`` hook returns a :class:`Node` for it (that
is how :func:`phalanx.synchronize` sees inside modules and optimizers).
:func:`jax_node` is such a hook for JAX pytrees (optax states, flax ``nnx``
state, equinox modules: any registered pytree node), used once jax is imported.

``unflatten`` updates mutable containers in place (dict, list, non-frozen
dataclass) and returns them; tuples, namedtuples and frozen dataclasses are
rebuilt, but only where a leaf below them changed, so an unchanged tree comes
back as the very same objects.
"""

from __future__ import annotations

import copy
import dataclasses
import sys
from collections.abc import Callable, Iterator
from typing import Any

from ._errors import InvalidArgumentError

__all__ = ["Node", "TreeSpec", "flatten", "jax_node", "unflatten"]


class Node:
    """How to look inside one container: path suffixes, children, and how to rebuild it.

    ``rebuild(values)`` gets the (possibly new) children in order and returns
    the container holding them: the same object when it was updated in place.
    """

    __slots__ = ("parts", "children", "rebuild")

    def __init__(self, parts: list[str], children: list[Any],
                 rebuild: Callable[[list[Any]], Any]) -> None:
        self.parts = parts
        self.children = children
        self.rebuild = rebuild


class TreeSpec:
    """The structure :func:`flatten` saw; ``None`` children mark leaves."""

    __slots__ = ("rebuild", "children")

    def __init__(self, rebuild: Callable[[list[Any]], Any], children: list[TreeSpec | None]) -> None:
        self.rebuild = rebuild
        self.children = children


Expand = Callable[[Any], "Node | None"]


def flatten(tree: Any, expand: Expand | None = None,
            path: str = "") -> tuple[list[tuple[str, Any]], TreeSpec | None]:
    """The leaves of ``tree`` as ``(path, leaf)`` pairs in a fixed order, and its structure."""
    leaves: list[tuple[str, Any]] = []
    spec = _flatten(tree, path, expand, leaves, set())
    return leaves, spec


def unflatten(spec: TreeSpec | None, values: list[Any]) -> Any:
    """Put ``values`` (one per leaf, in :func:`flatten`'s order) back into the structure."""
    it = iter(values)
    out = _build(spec, it)
    if next(it, _END) is not _END:
        raise InvalidArgumentError(f"phalanx unflatten: got {len(values)} values, more than the structure "
                                   "has leaves; pass one value per leaf of flatten()'s list.")
    return out


_END = object()


def _flatten(x: Any, path: str, expand: Expand | None, leaves: list[tuple[str, Any]],
             active: set[int]) -> TreeSpec | None:
    node = expand(x) if expand is not None else None
    if node is None:
        node = node_of(x)
    if node is None:
        leaves.append((path, x))
        return None
    if id(x) in active:
        raise InvalidArgumentError(f"{path or 'the object'} contains itself: a cyclic structure has no leaves to "
                         "flatten. Pass the parts you need instead.")
    active.add(id(x))
    try:
        children = [_flatten(child, path + part, expand, leaves, active)
                    for part, child in zip(node.parts, node.children, strict=True)]
    finally:
        active.discard(id(x))
    return TreeSpec(node.rebuild, children)


def _build(spec: TreeSpec | None, it: Iterator[Any]) -> Any:
    if spec is None:
        value = next(it, _END)
        if value is _END:
            raise InvalidArgumentError("phalanx unflatten: fewer values than leaves; pass one value per "
                                       "leaf of flatten()'s list.")
        return value
    return spec.rebuild([_build(child, it) for child in spec.children])


def node_of(x: Any) -> Node | None:
    """The :class:`Node` of a built-in container, or ``None`` for a leaf."""
    if isinstance(x, dict):
        keys = list(x)
        try:
            keys.sort()
        except TypeError:  # keys of mixed types: keep insertion order
            pass
        return Node([f"[{k!r}]" for k in keys], [x[k] for k in keys], _update_items(x, keys))
    if isinstance(x, list):
        return Node([f"[{i}]" for i in range(len(x))], list(x), _update_items(x, range(len(x))))
    if isinstance(x, tuple):
        fields = getattr(type(x), "_fields", None)
        if isinstance(fields, tuple):  # a namedtuple
            return Node([f".{f}" for f in fields], list(x), lambda values: _new_tuple(x, values, True))
        return Node([f"[{i}]" for i in range(len(x))], list(x), lambda values: _new_tuple(x, values, False))
    if dataclasses.is_dataclass(x) and not isinstance(x, type):
        names = [f.name for f in dataclasses.fields(x) if hasattr(x, f.name)]
        return Node([f".{n}" for n in names], [getattr(x, n) for n in names], _update_fields(x, names))
    return None


def _update_items(x: Any, keys: Any) -> Callable[[list[Any]], Any]:
    def rebuild(values: list[Any]) -> Any:
        for k, v in zip(keys, values, strict=True):
            if x[k] is not v:
                x[k] = v
        return x
    return rebuild


def _new_tuple(x: tuple[Any, ...], values: list[Any], named: bool) -> tuple[Any, ...]:
    if all(a is b for a, b in zip(x, values, strict=True)):
        return x
    if named:
        return type(x)(*values)
    return tuple(values) if type(x) is tuple else type(x)(values)


def _update_fields(x: Any, names: list[str]) -> Callable[[list[Any]], Any]:
    def rebuild(values: list[Any]) -> Any:
        changed = [(n, v) for n, v in zip(names, values, strict=True) if getattr(x, n) is not v]
        if not changed:
            return x
        frozen = type(x).__dataclass_params__.frozen
        target = copy.copy(x) if frozen else x
        for n, v in changed:
            if frozen:
                object.__setattr__(target, n, v)  # a frozen dataclass: a changed copy, never the original
            else:
                setattr(target, n, v)
        return target
    return rebuild


_BUILTIN = (dict, list, tuple)


def jax_node(x: Any) -> Node | None:
    """The :class:`Node` of a registered JAX pytree node (not dict/list/tuple), or ``None``.

    Path suffixes are JAX's own key strings (``.weight``, ``['w']``); the
    rebuilt node is JAX's unflatten of the new children (the same object when
    no child changed). ``None`` and arrays are leaves. jax is never imported here.
    """
    jax = sys.modules.get("jax")
    if jax is None or x is None or isinstance(x, _BUILTIN) or isinstance(x, jax.Array):
        return None
    tu = jax.tree_util
    pairs, treedef = tu.tree_flatten_with_path(x, is_leaf=lambda y: y is not x)
    if tu.treedef_is_leaf(treedef):
        return None
    children = [child for _, child in pairs]

    def rebuild(values: list[Any]) -> Any:
        if all(a is b for a, b in zip(children, values, strict=True)):
            return x
        return tu.tree_unflatten(treedef, values)

    return Node([tu.keystr(path) for path, _ in pairs], children, rebuild)

"""``shard="parameters"`` (ZeRO stage 3): each rank keeps 1/N of every parameter; units are gathered to run.

::

    shards = ParamShards(module, units, world, call, reshard_after_forward=True)
    out = shards.forward(module, *args)   # the root unit gathered; each unit gathered before its forward
    loss.backward()                       # units regathered for backward; gradients reduce-scattered per unit
    optimizer.step()                      # on the ShardedTensor parameters: this rank's elements only

A *unit* is a module whose parameters are gathered together
(:func:`pick_units`); the root unit holds every parameter no unit holds
alone (a parameter shared by two units, e.g. an output layer tied to the
token embedding, belongs to the root). Outside forward the modules hold
:class:`~phalanx.torch._shard_tensor.ShardedTensor` parameters, so
``model.parameters()`` yields them with their original shapes. A unit's
forward pre-hook gathers it (:class:`~phalanx.torch._flat_shard.FlatShard`)
and puts its whole parameters in the modules; its forward hook puts the
shards back, registers a pre-backward hook on its outputs, and frees the
whole memory (``reshard_after_forward``; always when no backward can
follow). Backward regathers a freed unit when the gradient of its output
arrives, and when autograd has accumulated the gradient of every
parameter of the unit that requires one (``register_post_accumulate_grad_hook``)
the unit's gradients are reduce-scattered and its memory freed; whatever is
left (frozen units, unused parameters) is reduced and freed when backward
ends (an autograd engine callback). Every rank runs the same graph, so the
collectives come in the same order on every rank.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch

from .._errors import InvalidArgumentError, UsageError
from ._flat_shard import FlatShard
from ._materialize import materialize
from ._shard_tensor import ShardedTensor, ShardOwner
from ._unit_order import UnitOrder

__all__ = ["ParamShards", "pick_units"]


def pick_units(call: str, root: torch.nn.Module, units: Any) -> list[tuple[str, torch.nn.Module]]:
    """The modules of ``root`` gathered as units, as (name, module) in module order.

    ``units``: module classes (every instance is a unit), a callable picking modules, or None: the
    default policy, every element of an ``nn.ModuleList`` (a transformer's blocks) and every other
    module with parameters beside the path to one (the embeddings, the final norm, the output
    layer); in a model without a ModuleList, every direct child with parameters."""
    if units is None:
        return _default_units(root)
    if isinstance(units, (list, tuple)):
        if not units or not all(isinstance(c, type) and issubclass(c, torch.nn.Module) for c in units):
            raise InvalidArgumentError(
                f"phalanx.{call}(units={units!r}): give module classes (e.g. units=[Block]), a callable "
                "that picks modules (units=lambda m: ...), or None (each block of the model's ModuleList).")
        classes = tuple(units)
        return [(n, m) for n, m in root.named_modules() if m is not root and isinstance(m, classes)]
    if callable(units):
        return [(n, m) for n, m in root.named_modules() if m is not root and units(m)]
    raise InvalidArgumentError(f"phalanx.{call}(units={units!r}): give module classes, a callable, or None.")


def _default_units(root: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    holds_list = {id(m) for _, m in root.named_modules()
                  if any(isinstance(c, torch.nn.ModuleList) for c in m.modules())}
    picked: list[tuple[str, torch.nn.Module]] = []

    def visit(module: torch.nn.Module, prefix: str) -> None:
        for name, child in module.named_children():
            if isinstance(child, torch.nn.ModuleList):
                for i, block in enumerate(child):
                    if next(block.parameters(), None) is not None:
                        picked.append((f"{prefix}{name}.{i}", block))
            elif id(child) in holds_list:
                visit(child, f"{prefix}{name}.")
            elif next(child.parameters(), None) is not None:
                picked.append((f"{prefix}{name}", child))

    visit(root, "")
    return picked


class _Unit:
    """A unit's flat shards, its parameter slots and where it is in this step."""

    def __init__(self, name: str, module: torch.nn.Module) -> None:
        self.name, self.module = name, module
        self.flats: list[FlatShard] = []
        self.slots: list[tuple[torch.nn.Module, str, ShardedTensor, torch.nn.Parameter]] = []
        self.generation = -1  # the root forward it was last gathered for
        self.expected: set[int] = set()  # wholes whose gradient backward will accumulate
        self.fired: set[int] = set()

    def install(self, whole: bool) -> None:
        """The modules hold the whole parameters (``whole``) or the shards."""
        for module, attr, shard, w in self.slots:
            module._parameters[attr] = w if whole else shard  # type: ignore[assignment]

    @property
    def live(self) -> bool:
        return any(f.live for f in self.flats)


class ParamShards(ShardOwner):
    """Every parameter of ``module`` sharded across ``world``'s ranks, gathered unit by unit."""

    private_storage = True  # each shard views its unit's chunk, which holds this rank's elements only

    def __init__(self, module: torch.nn.Module, units: Any, world: Any, group: Any, call: str,
                 reshard_after_forward: bool = True, param_dtype: torch.dtype | None = None,
                 reduce_dtype: torch.dtype | None = None) -> None:
        self.world, self.group, self.call = world, group, call
        self.param_dtype, self.reduce_dtype = param_dtype, reduce_dtype
        self.device = _device(world)  # where a model built on the meta device is materialized
        self.reshard_after_forward = bool(reshard_after_forward)
        self.sync = True  # False inside no_sync(): gradients accumulate in the wholes, unreduced
        self.generation = 0
        self._callback_queued = False
        self._suspended = False  # inside whole(): the hooks stand aside
        self._forward_order, self._backward_order = UnitOrder(), UnitOrder()  # what to prefetch
        picked = pick_units(call, module, units)
        _refuse_compiled(call, module)
        self.units = [_Unit(n, m) for n, m in picked]
        self.root = _Unit("", module)
        self._layout(module)
        for unit in self.units:
            unit.module.register_forward_pre_hook(self._hook_pre_forward(unit), prepend=True)
            unit.module.register_forward_hook(self._hook_post_forward(unit), always_call=True)
        for unit in self.all_units:
            for flat in unit.flats:
                for w in flat.wholes:  # a frozen one too: it may be unfrozen later
                    frozen = not w.requires_grad
                    w.requires_grad_(True)
                    w.register_post_accumulate_grad_hook(self._hook_accumulated(unit))
                    w.requires_grad_(not frozen)

    @property
    def all_units(self) -> list[_Unit]:
        return [*self.units, self.root]

    # -- layout ----------------------------------------------------------------------------
    def _layout(self, root: torch.nn.Module) -> None:
        """Assign every parameter to its unit (the root when two units share it), flatten each unit's
        parameters by dtype and device, and put the shards in the modules."""
        unit_of_module = {id(u.module): u for u in self.units}
        slots: list[tuple[torch.nn.Module, str, torch.nn.Parameter, _Unit]] = []
        names: dict[int, str] = {}
        holders: dict[int, set[int]] = {}

        def walk(module: torch.nn.Module, prefix: str, unit: _Unit) -> None:
            unit = unit_of_module.get(id(module), unit)
            for attr, p in module._parameters.items():
                if p is None:
                    continue
                slots.append((module, attr, p, unit))
                names.setdefault(id(p), f"{prefix}{attr}")
                holders.setdefault(id(p), set()).add(id(unit))
            for child_name, child in module._modules.items():
                if child is not None:
                    walk(child, f"{prefix}{child_name}.", unit)

        walk(root, "", self.root)
        owner: dict[int, _Unit] = {}
        members: dict[int, list[torch.nn.Parameter]] = {id(u): [] for u in self.all_units}
        for _, _, p, unit in slots:
            if id(p) not in owner:
                owner[id(p)] = unit if len(holders[id(p)]) == 1 else self.root
                members[id(owner[id(p)])].append(p)
        by_unit: dict[int, list[tuple[torch.nn.Module, str, torch.nn.Parameter]]] = {id(u): [] for u in self.all_units}
        for module, attr, p, _ in slots:
            by_unit[id(owner[id(p)])].append((module, attr, p))
        for unit in self.all_units:  # one unit at a time: built on the meta device, only it is ever whole
            mine = members[id(unit)]
            if any(p.is_meta for p in mine):
                made = materialize(self.call, by_unit[id(unit)], self.device)
                for old_id, p in made.items():
                    names[id(p)] = names[old_id]
                mine = list(made.values())
            groups: dict[tuple[torch.dtype, torch.device], list[torch.nn.Parameter]] = {}
            for p in mine:
                groups.setdefault((p.dtype, p.device), []).append(p)
            pairs: dict[int, tuple[ShardedTensor, torch.nn.Parameter]] = {}
            for params in groups.values():
                flat = FlatShard(self, unit.name, [(names[id(p)], p) for p in params], self.param_dtype,
                                 self.reduce_dtype)
                unit.flats.append(flat)
                for p, shard, w in zip(params, flat.shards, flat.wholes, strict=True):
                    pairs[id(p)] = (shard, w)
            for module, attr, _ in by_unit[id(unit)]:
                shard, w = pairs[id(module._parameters[attr])]  # (the materialized one, if it was on meta)
                unit.slots.append((module, attr, shard, w))
                module._parameters[attr] = shard  # type: ignore[assignment]  # an nn.Parameter (_is_param)

    # -- forward ---------------------------------------------------------------------------
    def forward(self, module: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
        """``module(*args, **kwargs)`` with the root unit gathered around it (a new step)."""
        self.generation += 1
        self._forward_order.begin()
        self._pre_forward(self.root)
        if self.param_dtype is not None:  # floating-point inputs in the compute dtype, as FSDP2 casts them
            args, kwargs = _cast(self.param_dtype, (args, kwargs))
        try:
            out = module(*args, **kwargs)
        except BaseException:
            self._post_forward(self.root, None)
            raise
        self._post_forward(self.root, out)
        return out

    def _pre_forward(self, unit: _Unit) -> None:
        if unit.generation != self.generation or not unit.live:
            self._start(unit)
        for flat in unit.flats:
            flat.finish_gather()
            flat.follow_requires_grad()
        unit.install(whole=True)
        if unit is not self.root and not _in_backward():  # (a recomputation has no next unit to prefetch)
            nxt = self._forward_order.step(unit)
            if nxt is not None and (nxt.generation != self.generation or not nxt.live):
                self._start(nxt)  # prefetched: its gather runs while this unit computes

    def _start(self, unit: _Unit) -> None:
        """Post the unit's gather for this step's forward."""
        for flat in unit.flats:
            flat.start_gather()
        unit.generation = self.generation
        unit.expected, unit.fired = set(), set()

    def _post_forward(self, unit: _Unit, out: Any) -> None:
        if _in_backward():  # activation checkpointing's recomputation: the unit's backward runs next
            unit.expected |= {id(w) for f in unit.flats for w in f.wholes if w.requires_grad}
            return  # kept whole and installed, freed when its gradients are in (_finish)
        unit.install(whole=False)
        backward = False
        if torch.is_grad_enabled():
            wanted = {id(w) for f in unit.flats for w in f.wholes if w.requires_grad}
            unit.expected |= wanted
            for t in _tensors(out):
                if t.requires_grad:
                    t.register_hook(self._hook_pre_backward(unit))
                    backward = True
        if not backward or (self.reshard_after_forward and unit is not self.root):
            self._free(unit)

    def _hook_pre_forward(self, unit: _Unit) -> Callable[..., None]:
        def hook(module: torch.nn.Module, args: Any) -> None:
            if not self._suspended:
                self._pre_forward(unit)
        return hook

    def _hook_post_forward(self, unit: _Unit) -> Callable[..., None]:
        def hook(module: torch.nn.Module, args: Any, out: Any) -> None:
            if not self._suspended:
                self._post_forward(unit, out)
        return hook

    # -- backward --------------------------------------------------------------------------
    def _hook_pre_backward(self, unit: _Unit) -> Callable[[torch.Tensor], None]:
        def hook(grad: torch.Tensor) -> None:
            if not self._callback_queued:
                torch.autograd.Variable._execution_engine.queue_callback(self._end_backward)
                self._callback_queued = True
                self._backward_order.begin()
            for flat in unit.flats:
                if not flat.live:  # freed after forward: regathered for backward
                    flat.start_gather()
                flat.finish_gather()
            unit.install(whole=True)  # a checkpointed part of its forward may be recomputed: whole there
            nxt = self._backward_order.step(unit)
            if nxt is not None and not nxt.live:
                for flat in nxt.flats:  # prefetched: its gather runs while this unit's backward computes
                    flat.start_gather()
        return hook

    def _hook_accumulated(self, unit: _Unit) -> Callable[[torch.Tensor], None]:
        def hook(w: torch.Tensor) -> None:
            unit.fired.add(id(w))
            if unit.expected and unit.fired >= unit.expected:
                self._finish(unit)
        return hook

    def _finish(self, unit: _Unit) -> None:
        """A unit whose backward is over: its gradients reduce-scattered (unless in no_sync), its memory freed."""
        if self.sync:
            for flat in unit.flats:
                if flat.has_grads():
                    flat.reduce(average=True)
        unit.expected, unit.fired = set(), set()
        self._free(unit)

    def _end_backward(self) -> None:
        """When backward ends: the units not finished yet (frozen, unused parameters), in unit order."""
        self._callback_queued = False
        for unit in self.all_units:
            if unit.live or (self.sync and any(f.has_grads() for f in unit.flats)):
                self._finish(unit)

    def reduce_pending(self) -> None:
        """Reduce-scatter the gradients accumulated without reducing (after ``no_sync()``; collective)."""
        for unit in self.all_units:
            for flat in unit.flats:
                if flat.has_grads():
                    flat.reduce(average=True)

    @contextlib.contextmanager
    def whole(self) -> Iterator[None]:
        """Every unit gathered and the modules holding whole parameters (collective on entry), for
        forwards that do not run on every rank alike (evaluation on uneven parts of a dataset): inside,
        the units' hooks communicate nothing. Gradients are not reduced in there."""
        self.generation += 1
        for unit in self.all_units:
            self._gather(unit)
            unit.generation = self.generation
            unit.install(whole=True)
        self._suspended = True
        try:
            yield
        finally:
            self._suspended = False
            for unit in self.all_units:
                unit.install(whole=False)
                self._free(unit)

    # -- gather and free -------------------------------------------------------------------
    def _gather(self, unit: _Unit) -> None:
        for flat in unit.flats:
            flat.gather()

    def _free(self, unit: _Unit) -> None:
        unit.install(whole=False)
        for flat in unit.flats:
            flat.free()

    def groups(self) -> list[FlatShard]:
        """Every unit's shard groups (one per dtype and device), in unit order."""
        return [f for u in self.all_units for f in u.flats]

    def shards(self) -> list[ShardedTensor]:
        """Every sharded parameter, in unit order."""
        return [s for u in self.all_units for f in u.flats for s in f.shards]


def _in_backward() -> bool:
    """Whether autograd is running a backward pass in this thread (a forward now is a recomputation)."""
    return bool(torch._C._current_graph_task_id() != -1)


def _refuse_compiled(call: str, root: torch.nn.Module) -> None:
    """UsageError naming the first module compiled with torch.compile: its graph would run the whole
    parameters without the units' gather and free hooks (untested: refused rather than risked)."""
    for name, m in root.named_modules():
        if type(m).__name__ == "OptimizedModule" or getattr(m, "_compiled_call_impl", None) is not None:
            raise UsageError(
                f"phalanx.{call}(shard='parameters'): the module {name or '(the model)'} "
                f"({type(m).__name__}) is compiled with torch.compile, whose graphs phalanx does not yet gather "
                "units for. Compile after training, or use shard='gradients' (whole parameters) with a compiled "
                "model.")


def _device(world: Any) -> torch.device:
    """This rank's device: its GPU on nccl, else the CPU."""
    if world.backend.name == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _cast(dtype: torch.dtype, tree: Any) -> Any:
    from torch.utils import _pytree as pytree

    return pytree.tree_map_only(torch.Tensor, lambda t: t.to(dtype) if t.is_floating_point() else t, tree)


def _tensors(out: Any) -> list[torch.Tensor]:
    from torch.utils import _pytree as pytree

    return [t for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor)]

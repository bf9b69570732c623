"""A unit of a model built on the meta device, made real: ``materialize``.

::

    with torch.device("meta"):
        model = GPT(config)                      # no memory: shapes only
    model = DataParallel(model, shard="parameters", units=[Block])   # materialized unit by unit

For each unit in turn, :class:`~phalanx.torch._param_shards.ParamShards`
calls :func:`materialize` with the unit's parameter slots: every meta
parameter gets real (uninitialized) memory on the rank's device, in every
module slot that holds it (tied weights stay tied), the modules' meta
buffers too, and each module holding them runs its ``reset_parameters()``.
The unit is then sharded and its whole memory released before the next
unit is made, so no rank ever holds more than one unit whole. The values
come from torch's global random generator with rank 0's state (broadcast
once, in :class:`~phalanx.torch.DataParallel`), so they are the same at
every number of ranks and on every rank.
"""

from __future__ import annotations

import torch

from .._errors import UsageError

__all__ = ["materialize"]


@torch.no_grad()
def materialize(call: str, slots: list[tuple[torch.nn.Module, str, torch.nn.Parameter]],
                device: torch.device) -> dict[int, torch.nn.Parameter]:
    """Give the meta parameters of ``slots`` (``(module, attribute, parameter)``, one unit's) memory on
    ``device`` and initialize them with their modules' ``reset_parameters()``; return the unit's
    parameters, materialized, by ``id()`` of the parameter each replaces, in the order of their first slot."""
    made: dict[int, torch.nn.Parameter] = {}
    modules: dict[int, torch.nn.Module] = {}
    for module, attr, p in slots:
        if id(p) not in made:
            made[id(p)] = torch.nn.Parameter(torch.empty_like(p, device=device), requires_grad=p.requires_grad) \
                if p.is_meta else p
        module._parameters[attr] = made[id(p)]
        modules[id(module)] = module
    for module in modules.values():
        for name, b in module._buffers.items():
            if b is not None and b.is_meta:
                module._buffers[name] = torch.empty_like(b, device=device)
        if any(p is not None and p.is_meta for p in module._parameters.values()):
            raise UsageError(
                f"phalanx.{call}: {type(module).__name__} holds parameters gathered in two units, so it cannot "
                "be initialized from the meta device one unit at a time. Make the module one unit (units=...), "
                "or build the model on a real device.")
        reset = getattr(module, "reset_parameters", None)
        if callable(reset):
            reset()
        elif module._parameters:
            raise UsageError(
                f"phalanx.{call}: {type(module).__name__} was built on the meta device and has no "
                "reset_parameters() to initialize its parameters "
                f"({', '.join(module._parameters)}). Give it one, or build the model on a real device.")
    return made

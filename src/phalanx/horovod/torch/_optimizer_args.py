"""The arguments of Horovod's ``DistributedOptimizer``, checked as Horovod checks them.

::

    passes = check_passes(backward_passes_per_step)
    names = names_of(optimizer, named_parameters)   # {id(parameter): name}, Horovod's checks
    groups = check_groups(groups, num_groups)

Each raises :class:`phalanx.InvalidArgumentError` naming the argument and the fix.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch

from ..._errors import InvalidArgumentError

__all__ = ["CALL", "check_groups", "check_passes", "names_of"]

CALL = "phalanx.horovod.torch.DistributedOptimizer"


def check_passes(passes: Any) -> int:
    if isinstance(passes, bool) or not isinstance(passes, int) or passes < 1:
        raise InvalidArgumentError(f"{CALL}(backward_passes_per_step={passes!r}): give the number of backward "
                                   "passes per step as an int >= 1.")
    return passes


def names_of(optimizer: torch.optim.Optimizer, named_parameters: Any) -> dict[int, str]:
    """Horovod's checks of ``named_parameters``: (name, tensor) tuples, unique names, every parameter named."""
    if named_parameters is None:
        return {}
    entries = list(named_parameters)
    bad = next((e for e in entries if not isinstance(e, tuple) or len(e) != 2), None)
    if bad is not None:
        raise InvalidArgumentError(
            f"{CALL}(named_parameters=...): named_parameters should be a sequence of tuples (name, "
            f"parameter), usually produced by model.named_parameters(); got an entry {type(bad).__name__}.")
    seen: set[str] = set()
    dups = sorted({n for n, _ in entries if n in seen or seen.add(n)})  # type: ignore[func-returns-value]
    if dups:
        raise InvalidArgumentError(f"{CALL}(named_parameters=...): parameter names in named_parameters must "
                                   f"be unique. Found duplicates: {', '.join(map(str, dups))}.")
    names = {id(p): str(n) for n, p in entries}
    unnamed = [f"param_groups[{g}]['params'][{k}] (shape {list(p.shape)})"
               for g, group in enumerate(optimizer.param_groups)
               for k, p in enumerate(group["params"]) if id(p) not in names]
    if unnamed:
        raise InvalidArgumentError(
            f"{CALL}(named_parameters=...): named_parameters was specified, but one or more model "
            f"parameters were not named: {', '.join(unnamed[:5])}{' ...' if len(unnamed) > 5 else ''}. "
            "Pass the named_parameters() of the model whose parameters the optimizer holds.")
    return names


def check_groups(groups: Any, num_groups: Any) -> Any:
    if num_groups:
        warnings.warn("Parameter `num_groups` has been replaced by `groups` and will be removed in v0.23.0.",
                      DeprecationWarning, stacklevel=3)
        if groups is None:
            groups = num_groups
    if groups is None:
        return None
    if isinstance(groups, list):
        seen: set[int] = set()
        for group in groups:
            for p in group:
                if not isinstance(p, torch.Tensor):
                    raise InvalidArgumentError(f"{CALL}(groups=...): groups must consist of torch.Tensor; "
                                               f"got a {type(p).__name__}.")
                if id(p) in seen:
                    raise InvalidArgumentError(f"{CALL}(groups=...): a parameter can only appear once in groups.")
                seen.add(id(p))
        return groups
    if isinstance(groups, bool) or not isinstance(groups, int) or groups <= 0:
        raise InvalidArgumentError(f"{CALL}(groups={groups!r}): groups should be a non-negative integer or "
                                   "a list of list of torch.Tensor.")
    return groups

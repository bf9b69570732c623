"""Which parameters a gradient engine reduces: those that required gradients when it was made.

::

    trainable = Trainable(model.named_parameters())     # when the wrapper makes its engine
    ...
    trainable.check(call, fix)     # at the next step: UsageError naming a parameter whose flag changed

The engine (``_bucket.py``) leaves out the parameters that were frozen when it
was made. One unfrozen afterwards gets a gradient from autograd that no rank
reduces: each rank would train it on its own batch and the replicas would
drift apart with no error. So both wrappers refuse the change at their next
step, naming the parameter: ``DataParallel`` at its forward,
``DistributedOptimizer`` at ``step()`` (before the update, so nothing diverged).
``DataParallel(shard="parameters")`` follows such changes instead (its units
reduce whatever has a gradient).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from .._errors import UsageError

__all__ = ["Trainable"]


class Trainable:
    """The ``requires_grad`` flags of a wrapper's parameters when its engine was made."""

    def __init__(self, named: Iterable[tuple[str, torch.Tensor]]) -> None:
        self._named = list(named)
        self._flags = [p.requires_grad for _, p in self._named]

    def changed(self) -> list[str]:
        """The parameters whose flag changed, each as ``"name (now requires_grad=...)"``."""
        if [p.requires_grad for _, p in self._named] == self._flags:
            return []
        return [f"{n} (now requires_grad={p.requires_grad})" for (n, p), was in zip(self._named, self._flags,
                                                                                    strict=True)
                if p.requires_grad != was]

    def check(self, call: str, fix: str) -> None:
        """UsageError naming the parameters whose ``requires_grad`` changed since the engine was made;
        ``fix`` says how to change it instead (the wrapper's own way to wrap again)."""
        changed = self.changed()
        if changed:
            more = f" and {len(changed) - 4} more" if len(changed) > 4 else ""
            raise UsageError(
                f"phalanx.{call}: requires_grad changed after wrapping: {', '.join(changed[:4])}{more}. The "
                "gradient engine reduces the parameters that required gradients when it was made, so this "
                "rank would train the others on its own gradients and the ranks would drift apart. Set "
                f"requires_grad before wrapping, or {fix}; DataParallel(shard='parameters') follows such "
                "changes by itself.")

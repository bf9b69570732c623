"""What ``phalanx.torch.DistributedOptimizer`` shares with the optimizer it wraps, and what it says of the
names it lacks.

``param_groups``, ``state`` and ``defaults`` are the wrapped optimizer's own objects, read and
assigned through, so LR schedulers, ``GradScaler`` and checkpoints see one optimizer. Horovod's
``synchronize()``/``skip_synchronize()`` have no place here (backward has already reduced), so asking
for them names what to call instead.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

__all__ = ["SharedWithWrapped"]


class SharedWithWrapped:
    """Mixin: ``param_groups``, ``state`` and ``defaults`` are ``self.optimizer``'s."""

    optimizer: torch.optim.Optimizer
    hint_call = "torch.DistributedOptimizer"  # the class's name in phalanx's messages

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.optimizer.param_groups

    @param_groups.setter
    def param_groups(self, value: list[dict[str, Any]]) -> None:
        self.optimizer.param_groups = value

    @property
    def state(self) -> Any:
        return self.optimizer.state

    @state.setter
    def state(self, value: Any) -> None:
        self.optimizer.state = value

    @property
    def defaults(self) -> dict[str, Any]:
        return self.optimizer.defaults

    @defaults.setter
    def defaults(self, value: dict[str, Any]) -> None:
        self.optimizer.defaults = value

    def __getattr__(self, name: str) -> Any:
        """Only for names not found: a hint where a Horovod user expects ``synchronize()``."""
        if name in ("synchronize", "skip_synchronize"):
            raise AttributeError(
                f"phalanx.{self.hint_call} has no {name}(): the gradients are already averaged when backward() "
                "returns, so call opt.step() directly; to accumulate without reducing, use "
                "`with opt.no_sync():` (or backward_passes_per_step=k). Horovod's API, synchronize() "
                "included, is phalanx.horovod.torch.DistributedOptimizer.")
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

"""What ``DistributedOptimizer`` and ``DataParallel``'s bucket front (``_fronts.py``) share: their
gradient engine and its non-finite policy.

::

    opt.engine                     # the GradientBuckets reducing the gradients (its extension points)
    opt.nonfinite = "skip"         # None, "raise" or "skip"
    opt.nonfinite_ranks()          # after a reduction: the ranks whose own gradients were not finite
"""

from __future__ import annotations

from ._bucket import GradientBuckets
from ._finite import NonFinitePolicy, check_policy

__all__ = ["EngineOwner"]


class EngineOwner:
    """A wrapper that reduces its gradients with one :class:`GradientBuckets`, held in ``_engine``."""

    _engine: GradientBuckets

    @property
    def engine(self) -> GradientBuckets:
        """The gradient engine reducing these gradients while backward runs (replaced when parameters
        are added). Its extension points, for code that changes how gradients are reduced: a
        ``reducer`` (how each bucket is reduced) and hooks run at each backward pass (``pass_hooks``),
        before each reduction (``reduction_hooks``) and after each bucket (``bucket_hooks``);
        ``docs/design.md``, "Gradient reduction", has their order and contract."""
        return self._engine

    @property
    def nonfinite(self) -> NonFinitePolicy | None:
        """The non-finite gradient policy: None (no check), ``"raise"`` or ``"skip"``; settable."""
        return self._engine.on_nonfinite

    @nonfinite.setter
    def nonfinite(self, policy: NonFinitePolicy | None) -> None:
        engine = self._engine
        engine.on_nonfinite = check_policy(engine.call, policy)
        engine.check_finite = policy is not None

    def nonfinite_ranks(self) -> list[int]:
        """The ranks whose own gradients held NaN/Inf in the last reduction ([] if none, or without
        ``nonfinite``); the same list on every rank."""
        return list(self._engine.nonfinite_ranks)

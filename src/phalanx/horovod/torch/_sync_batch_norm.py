"""Horovod's ``hvd.SyncBatchNorm``, on phalanx's synchronized batch normalization.

::

    model.bn = hvd.SyncBatchNorm(64)      # or convert a model: phalanx.torch.convert_sync_batchnorm(model)
"""

from __future__ import annotations

from typing import Any

from ..._errors import UnsupportedArgumentError
from ...torch._syncbn import SyncBatchNorm as _PhalanxSyncBatchNorm
from ._functions import group_of

__all__ = ["SyncBatchNorm"]


class SyncBatchNorm(_PhalanxSyncBatchNorm):
    """Batch normalization whose training-mode statistics are those of every rank's batch together.

    Horovod's signature on :class:`phalanx.torch.SyncBatchNorm`: N ranks train like one process
    on the concatenated batch (different batch sizes per rank allowed), on CPU as on GPU (Horovod
    requires GPU input), in any number of dimensions ``(N, C, *)``. Eval mode uses the running
    statistics, with no communication. Every rank must run the same training-mode passes.

    Arguments:
        num_features: C, the number of channels.
        eps: added to the variance (default 1e-5).
        momentum: of the running statistics (default 0.1; None: a cumulative average).
        affine: learnable scale and shift (default True).
        track_running_stats: keep running statistics (default True).
        process_set: only the global process set (the default) is supported.

    Raises UnsupportedArgumentError for another process set; InvalidArgumentError (from forward)
    for an input of fewer than 2 dimensions or one value per channel over all ranks.
    """

    def __init__(self, num_features: int, eps: float = 1e-5, momentum: float | None = 0.1,
                 affine: bool = True, track_running_stats: bool = True, process_set: Any = None) -> None:
        if group_of(process_set) is not None:
            raise UnsupportedArgumentError(
                f"phalanx.horovod.torch.SyncBatchNorm({num_features}, process_set={process_set!r}): the "
                "statistics are reduced over every rank; only the global process set is supported. Omit "
                "process_set.")
        super().__init__(num_features, eps, momentum, affine, track_running_stats)
        self.process_set = process_set

"""Horovod's PyTorch API on phalanx: ``import phalanx.horovod.torch as hvd``.

A script written for ``horovod.torch`` runs unchanged but for that import, on
phalanx's collectives and gradient engine (MPI or gloo, no compiled extension),
with phalanx's timeouts and mismatch errors where Horovod would stall. What
differs from Horovod, and why, is in ``docs/horovod.md``.
"""

from ..common.exceptions import HorovodInternalError, HostsUpdatedInterrupt  # where Horovod has them
from . import (
    _adasum,
    _async,
    _autograd,
    _basics,
    _compression,
    _functions,
    _join,
    _ops,
    _optimizer,
    _process_sets,
    _sync_batch_norm,
    _timeline,
)
from . import elastic as elastic  # hvd.elastic: run, TorchState, ElasticSampler
from ._adasum import *  # noqa: F403
from ._async import *  # noqa: F403
from ._autograd import *  # noqa: F403
from ._basics import *  # noqa: F403
from ._compression import *  # noqa: F403
from ._functions import *  # noqa: F403
from ._join import *  # noqa: F403
from ._ops import *  # noqa: F403
from ._optimizer import *  # noqa: F403
from ._process_sets import *  # noqa: F403
from ._sync_batch_norm import *  # noqa: F403
from ._timeline import *  # noqa: F403

__all__ = ["HorovodInternalError", "HostsUpdatedInterrupt", "elastic", *sorted({name for module in (_adasum, _async, _autograd, _basics, _compression, _functions,
                                                   _join, _ops, _optimizer, _process_sets, _sync_batch_norm,
                                                   _timeline) for name in module.__all__})]

"""phalanx: data-parallel training over MPI, Gloo and NCCL.

::

    import phalanx
    phalanx.init()                       # mpi / gloo / nccl as launched, else a world of one
    total = phalanx.allreduce(np.ones(3))  # [size, size, size]
    phalanx.print("hello")               # "[rank/size] hello"

Importing phalanx imports no torch, jax or mpi4py: backends and framework
adapters load them when they are used.
"""

from __future__ import annotations

from ._collectives import (
    allgather,
    allreduce,
    alltoall,
    barrier,
    broadcast,
    gather,
    reduce,
    reduce_scatter,
)
from ._data import DistributedDataContainer
from ._epochs import epoch
from ._errors import (
    BackendUnavailableError,
    CheckpointError,
    CollectiveMismatchError,
    CollectiveTimeoutError,
    ImageReadError,
    InvalidArgumentError,
    InvalidSettingError,
    JobFailedError,
    LaunchEnvironmentError,
    LaunchError,
    MissingDependencyError,
    NonFiniteGradientError,
    NotInGroupError,
    NotInitializedError,
    PhalanxError,
    QuorumLostError,
    RankFailedError,
    RendezvousError,
    SimulatedHostsUnavailableError,
    TrainingError,
    UnknownMetricError,
    UnsupportedArgumentError,
    UsageError,
    WorldBrokenError,
)
from ._gradients import allreduce_gradients
from ._groups import Group, destroy_group, new_group, world_group
from ._nonblocking import Handle, iallreduce, ibroadcast
from ._objects import allgather_object, broadcast_object
from ._output import RankFilter, print, setup_logging
from ._reconfigure import on_reform
from ._reform import reform, replacement_waiting
from ._settings import settings
from ._shutdown import shutdown
from ._sync import synchronize
from ._trace import start_trace, stop_trace
from ._world import (
    backend,
    device,
    init,
    initialized,
    local_rank,
    local_size,
    rank,
    size,
)
from .comm import Backend, BackendName, Op

__version__ = "0.1.0"

__all__ = [
    "Backend",
    "BackendName",
    "BackendUnavailableError",
    "CheckpointError",
    "CollectiveMismatchError",
    "CollectiveTimeoutError",
    "DistributedDataContainer",
    "Handle",
    "ImageReadError",
    "InvalidArgumentError",
    "InvalidSettingError",
    "JobFailedError",
    "LaunchEnvironmentError",
    "LaunchError",
    "MissingDependencyError",
    "Group",
    "NonFiniteGradientError",
    "NotInGroupError",
    "NotInitializedError",
    "Op",
    "PhalanxError",
    "QuorumLostError",
    "RankFailedError",
    "RankFilter",
    "RendezvousError",
    "SimulatedHostsUnavailableError",
    "TrainingError",
    "UnknownMetricError",
    "UnsupportedArgumentError",
    "UsageError",
    "WorldBrokenError",
    "__version__",
    "allgather",
    "allgather_object",
    "allreduce",
    "allreduce_gradients",
    "alltoall",
    "backend",
    "barrier",
    "broadcast",
    "broadcast_object",
    "destroy_group",
    "device",
    "gather",
    "iallreduce",
    "ibroadcast",
    "epoch",
    "init",
    "initialized",
    "local_rank",
    "local_size",
    "new_group",
    "on_reform",
    "print",
    "rank",
    "reform",
    "replacement_waiting",
    "reduce",
    "reduce_scatter",
    "settings",
    "setup_logging",
    "shutdown",
    "size",
    "start_trace",
    "stop_trace",
    "synchronize",
    "world_group",
]

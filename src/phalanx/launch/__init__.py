"""Starting and supervising the ranks of a job: the library behind ``phalanx run`` and ``phalanx.testing``.

::

    from phalanx.launch import Launch, launch

    status = launch(Launch(n=4, backend="gloo", target=["train.py", "--lr", "0.1"]))

MPI jobs run under the ``mpiexec`` that matches mpi4py; gloo and nccl ranks
are spawned and supervised here. Either way the first failure stops every
rank within seconds and is reported with its rank and traceback, a rank that
never reaches ``phalanx.init`` is named after the start timeout, and a
Ctrl-C or SIGTERM stops every rank. gloo/nccl jobs on several hosts run either
one launcher per host (``Launch(nnodes=N, node_rank=K, master="h0:29500")``,
torchrun's convention) or one driver that starts them all over ssh
(``Launch(hosts="h0:2,h1:2")``, horovodrun's). Nothing heavy is imported: no
torch, no mpi4py.
"""

from __future__ import annotations

from .._errors import LaunchError
from ._backend import default_backend
from ._job import Launch
from ._launch import launch
from ._mpi_flavor import find_mpiexec

__all__ = ["Launch", "LaunchError", "default_backend", "find_mpiexec", "launch"]

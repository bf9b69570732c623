"""The store of a world with epochs, served by the launcher for the whole job (:mod:`phalanx._epochs`).

:func:`serve` is the launcher's side: torch's ``TCPStore`` server on a loopback
socket phalanx binds itself (torch's own would listen on every interface), behind
the job's guard (:mod:`._guard`: only connections proving ``PHALANX_SECRET`` reach
it), on the port the ranks know as ``MASTER_PORT``. :func:`connect` is a rank's:
a guard client and a store client through it, kept for the process's lifetime,
whatever epoch its world is in. Each epoch's rendezvous and process group use
keys of their own on the same store (``phalanx-e<E>/``), so nothing of an old
epoch, not even its stale addresses, can reach a new one.
"""

from __future__ import annotations

import socket
from datetime import timedelta
from typing import Any

from ._guard import Guard
from ._netplan import job_key

__all__ = ["StoreServer", "connect", "serve"]


class StoreServer:
    """The launcher's store: ``store`` (a client of its own server), ``port`` (the guarded one, for the ranks)."""

    def __init__(self, store: Any, guard: Guard, port: int) -> None:
        self.store, self.guard, self.port = store, guard, port

    def close(self) -> None:
        """Stop the guard (nothing listens afterwards) and drop the store."""
        self.guard.close()
        self.store = None


def serve(port: int, secret: str, address: str = "127.0.0.1") -> StoreServer:
    """Serve the job's store at ``address:port`` (loopback unless the ranks are on several hosts) behind a
    guard proving ``secret``; OSError when a bind fails. The store itself listens on loopback only."""
    import torch.distributed as dist

    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind(("127.0.0.1", 0))
    listener.listen(1024)
    inner = listener.getsockname()[1]
    store = dist.TCPStore("127.0.0.1", inner, None, True, timedelta(seconds=60), wait_for_workers=False,
                          master_listen_fd=listener.detach())
    guard = Guard.serve([address], port, inner, secret.encode())
    return StoreServer(store, guard, port)


def connect(where: str, timeout: float) -> tuple[Any, Guard]:
    """A store client of the launcher's store at ``where`` ("host:port"), through a guard of this rank's."""
    import torch.distributed as dist

    host, _, port = where.rpartition(":")
    guard = Guard.client(host, int(port), job_key(host), timeout)
    try:
        store = dist.TCPStore("127.0.0.1", guard.port, None, False, timedelta(seconds=min(timeout, 30.0)),
                              wait_for_workers=False)
    except BaseException:
        guard.close()
        raise
    return store, guard

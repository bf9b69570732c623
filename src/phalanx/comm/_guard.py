"""The guarded rendezvous: phalanx's handshake in front of torch's ``TCPStore``.

torch's store has no authentication: anyone who reaches its port reads and
writes the job's keys. So across hosts rank 0 serves the real store on a
loopback port only, and a guard listens on the chosen address at
``MASTER_PORT``; the other ranks' store clients connect to a loopback port of
their own guard, which forwards each connection to rank 0's guard. A
connection carries store bytes only after both guards proved that they hold
the job's secret (``PHALANX_SECRET``). Why, and what it does not protect, is in
``docs/design.md`` ("The guarded rendezvous").

Here is :class:`Guard`: its listening sockets, the limits on connections
still in their handshake, and the one daemon thread per guard that runs every
connection through a selector. The handshake itself (its messages and sizes)
and the copying of one connection's bytes are :class:`~._guard_link.Link`'s,
in :mod:`._guard_link`.
"""

from __future__ import annotations

import contextlib
import selectors
import socket
import sys
import threading
import time
from typing import Any

from ._guard_link import HANDSHAKE_S, Link

__all__ = ["HANDSHAKE_S", "Guard"]

_PENDING = 256      # handshakes in progress at once; more connections are closed at once
_PER_SOURCE = 64    # of which from one address (so one host cannot take every place)
_LOGGED = 20        # refusals written to stderr; later ones are counted only
_R = selectors.EVENT_READ


class Guard:
    """A guard's listening sockets and the thread that serves their connections.

    Made by :meth:`serve` (rank 0) or :meth:`client` (the other ranks); ``port`` is the
    local port torch's store client connects to (client); :attr:`failure` says why the last
    connection to rank 0's guard failed. :meth:`close` stops it.
    """

    def __init__(self, key: bytes, serving: bool) -> None:
        self.key, self.serving = key, serving
        self.store_port = self.port = 0
        self.upstream: Any = None
        self.family = socket.AF_INET
        self.where = ""
        self.until = 0.0
        self.silence_s = 0.0
        self.refusal: str | None = None     # a client whose handshake failed: why (kept for good)
        self.unreachable: str | None = None  # why the last connection to rank 0's guard failed
        self.refusals = 0
        self._selector = selectors.DefaultSelector()
        self._listeners: list[socket.socket] = []
        self._links: list[Link] = []
        self._stop = False
        self._wake_r, self._wake_w = socket.socketpair()
        self._selector.register(self._wake_r, _R, None)
        self._thread = threading.Thread(target=self._run, name="phalanx-guard", daemon=True)

    @classmethod
    def serve(cls, addresses: list[str], port: int, store_port: int, key: bytes) -> Guard:
        """Rank 0's guard: listens on each of ``addresses`` at ``port`` and lets connections that
        prove ``key`` through to the store on ``127.0.0.1:store_port``. Raises OSError when a bind fails."""
        guard = cls(key, serving=True)
        guard.store_port, guard.port = store_port, port
        try:
            for address in addresses:
                family, kind, proto, _, where = socket.getaddrinfo(address, port, type=socket.SOCK_STREAM)[0]
                sock = socket.socket(family, kind, proto)
                guard._listeners.append(sock)
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                sock.bind(where)
                sock.listen(128)
        except OSError:
            guard.close()
            raise
        guard._start()
        return guard

    @classmethod
    def client(cls, host: str, port: int, key: bytes, connect_s: float) -> Guard:
        """A rank's guard: a loopback listener whose connections go to rank 0's guard at ``host:port``
        once the handshake with ``key`` passed (connections refused are retried for ``connect_s`` s)."""
        guard = cls(key, serving=False)
        family, _, _, _, guard.upstream = socket.getaddrinfo(host.strip("[]"), port, type=socket.SOCK_STREAM)[0]
        guard.family, guard.where, guard.until = family, f"{host}:{port}", time.monotonic() + connect_s
        guard.silence_s = connect_s  # the rank's timeout: a peer silent that long is lost
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        guard._listeners.append(sock)
        sock.bind(("127.0.0.1", 0))
        sock.listen(128)
        guard.port = sock.getsockname()[1]
        guard._start()
        return guard

    @property
    def failure(self) -> str | None:
        """Why connections to rank 0's guard fail (a refused handshake first), or None."""
        return self.refusal or self.unreachable

    def _start(self) -> None:
        for sock in self._listeners:
            sock.setblocking(False)
            self._selector.register(sock, _R, None)
        self._thread.start()

    def close(self) -> None:
        """Stop the thread (within 2 s) and close every socket of the guard."""
        self._stop = True
        with contextlib.suppress(OSError):
            self._wake_w.send(b"x")
        if self._thread.is_alive():
            self._thread.join(2.0)
        if not self._thread.is_alive():
            self._close_all()

    def refused(self, peer: str) -> None:
        self.refusals += 1
        if self.refusals <= _LOGGED:
            more = " (later refusals are not shown)" if self.refusals == _LOGGED else ""
            with contextlib.suppress(Exception):
                sys.stderr.write(f"phalanx: refused a rendezvous connection from {peer} "
                                 f"(wrong or missing secret){more}\n")
                sys.stderr.flush()

    def drop(self, sock: socket.socket | None) -> None:
        if sock is None:
            return
        with contextlib.suppress(KeyError, ValueError, RuntimeError, AttributeError):
            self._selector.unregister(sock)
        sock.close()

    # -- the thread ------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while not self._stop:
                now = time.monotonic()
                waits = [link.retry_at if link.state == "retry" else link.deadline
                         for link in self._links if link.state != "splice"]
                timeout = max(0.0, min([*waits, now + 1.0]) - now)
                for key, events in self._selector.select(timeout):
                    if key.fileobj is self._wake_r:
                        continue
                    if key.data is None:
                        self._accept(key.fileobj)  # type: ignore[arg-type]
                    elif not key.data.closed:
                        key.data.ready(key.fileobj, events)
                now = time.monotonic()
                for link in self._links:
                    if not link.closed:
                        link.tick(now)
                self._links = [link for link in self._links if not link.closed]
                for link in self._links:
                    self._watch(link)
        finally:
            self._close_all()

    def _accept(self, listener: socket.socket) -> None:
        try:
            sock, address = listener.accept()
        except OSError:
            return
        peer = f"{address[0]}:{address[1]}" if ":" not in address[0] else f"[{address[0]}]:{address[1]}"
        pending = [link for link in self._links if link.state != "splice"]
        source = peer.rsplit(":", 1)[0]
        if len(pending) >= _PENDING or sum(link.peer.rsplit(":", 1)[0] == source for link in pending) >= _PER_SOURCE:
            sock.close()  # too many handshakes at once (from this address): not a verdict on its secret
            return
        if self.refusal is not None:  # refused once, refused again: torch's client fails at once
            sock.close()
            return
        link = Link(self, sock, peer)
        self._links.append(link)
        if not self.serving:
            link.connect()

    def _watch(self, link: Link) -> None:
        for sock in (link.a, link.b):
            if sock is None or sock.fileno() < 0:
                continue
            events = link.interest(sock)
            registered = self._selector.get_map().get(sock)
            if events and registered is None:
                self._selector.register(sock, events, link)
            elif events and registered is not None and registered.events != events:
                self._selector.modify(sock, events, link)
            elif not events and registered is not None:
                self._selector.unregister(sock)

    def _close_all(self) -> None:
        for link in self._links:
            link.close()
        self._links = []
        for sock in [*self._listeners, self._wake_r, self._wake_w]:
            self.drop(sock)
        self._listeners = []
        with contextlib.suppress(Exception):
            self._selector.close()

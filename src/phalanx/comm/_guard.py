"""The guarded rendezvous: phalanx's handshake in front of torch's ``TCPStore``.

torch's store has no authentication: anyone who reaches its port reads and
writes the job's keys. So across hosts rank 0 serves the real store on a
loopback port only, and a guard listens on the chosen address at
``MASTER_PORT``; the other ranks' store clients connect to a loopback port of
their own guard, which forwards each connection to rank 0's guard. A
connection carries store bytes only after both guards proved that they hold
the job's secret (``PHALANX_SECRET``)::

    client -> server  HELLO      b"PHXG\\x01" + Nc                    (37 bytes)
    server -> client  CHALLENGE  b"PHXG\\x01" + Ns + HMAC(K, "phalanx guard server" + Nc + Ns)   (69 bytes)
    client -> server  PROOF      HMAC(K, "phalanx guard client" + Nc + Ns)   (32 bytes)
    server -> client  ACCEPT     b"\\x01"                               (1 byte)

``Nc``/``Ns`` are 32 random bytes each (``os.urandom``), ``K`` the secret's
UTF-8 bytes, HMAC is HMAC-SHA256 and every comparison is constant-time
(``hmac.compare_digest``). Every message has a fixed size and the server reads
exactly that many bytes; a connection that has not finished within
:data:`HANDSHAKE_S` is closed. Why, and what it does not protect, is in
``docs/design.md`` ("The guarded rendezvous").

One daemon thread per guard runs every connection through a selector.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import hmac
import os
import selectors
import socket
import sys
import threading
import time
from typing import Any

__all__ = ["HANDSHAKE_S", "Guard"]

MAGIC = b"PHXG\x01"
NONCE = 32
HELLO = len(MAGIC) + NONCE
CHALLENGE = len(MAGIC) + NONCE + 32
PROOF = 32
ACCEPT = b"\x01"
HANDSHAKE_S = 5.0   # a connection must have proved the secret this soon after it was made
_BUFFER = 1 << 20   # bytes held per direction before the guard stops reading that side
_PENDING = 256      # handshakes in progress at once; more connections are closed at once
_PER_SOURCE = 64    # of which from one address (so one host cannot take every place)
_LOGGED = 20        # refusals written to stderr; later ones are counted only
_R, _W = selectors.EVENT_READ, selectors.EVENT_WRITE


def _mac(key: bytes, label: bytes, nc: bytes, ns: bytes) -> bytes:
    return hmac.new(key, label + nc + ns, hashlib.sha256).digest()


def _quick(sock: socket.socket) -> None:
    """Non-blocking, and small writes sent at once: a store request forwarded in pieces must not
    wait for the peer's delayed acknowledgement (Nagle's algorithm)."""
    sock.setblocking(False)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


class _Link:
    """One guarded connection: the handshake on one socket, then bytes copied both ways."""

    def __init__(self, guard: Guard, a: socket.socket, peer: str) -> None:
        self.guard, self.a, self.peer = guard, a, peer
        self.b: socket.socket | None = None
        self.state = "hello" if guard.serving else "connect"
        self.need = HELLO
        self.inbox, self.hs_out = bytearray(), bytearray()
        self.to_a, self.to_b = bytearray(), bytearray()
        self.eof_a = self.eof_b = self.closed = False
        # A client's first connections may wait for rank 0 until the guard's own deadline
        # (the rendezvous timeout); later ones (torch reconnecting) for a handshake's time.
        self.deadline = time.monotonic() + HANDSHAKE_S if guard.serving else max(guard.until,
                                                                                  time.monotonic() + HANDSHAKE_S)
        self.retry_at = 0.0
        self.tries = 0
        self.nc = self.expected = b""
        self.forged = False  # rank 0's side failed to prove the secret: no retry can help
        _quick(a)

    # -- which events each socket waits for ----------------------------------------
    def interest(self, sock: socket.socket) -> int:
        hs = self.a if self.guard.serving else self.b
        if self.state == "splice":
            into, out, eof = (self.to_b, self.to_a, self.eof_a) if sock is self.a else (self.to_a, self.to_b, self.eof_b)
            return (_R if not eof and len(into) < _BUFFER else 0) | (_W if out else 0)
        if sock is hs:
            if self.state == "connect" or self.hs_out:
                return _W
            return _R if self.state in ("hello", "proof", "challenge", "accept") else 0
        if sock is self.a and not self.eof_a and len(self.to_b) < _BUFFER:  # torch's bytes, held
            return _R
        return 0

    # -- events ---------------------------------------------------------------------
    def ready(self, sock: socket.socket, events: int) -> None:
        try:
            if events & _W:
                self._writable(sock)
            if events & _R and not self.closed:
                self._readable(sock)
        except (BlockingIOError, InterruptedError):  # a wake-up with nothing to do: wait again
            return
        except OSError as exc:
            self.fail(f"{exc.strerror or exc}")
            return
        if self.state == "splice" and ((self.eof_a and not self.to_b) or (self.eof_b and not self.to_a)):
            self.close()

    def _writable(self, sock: socket.socket) -> None:
        if self.state == "connect":
            self._connected()
        elif self.state == "splice":
            out = self.to_a if sock is self.a else self.to_b
            del out[:sock.send(out)]
        else:
            del self.hs_out[:sock.send(self.hs_out)]

    def _readable(self, sock: socket.socket) -> None:
        hs = self.a if self.guard.serving else self.b
        if self.state != "splice" and sock is hs:
            data = sock.recv(self.need - len(self.inbox))
            if not data:
                self.fail("it closed the connection during the handshake (it is not a phalanx guard, "
                          "or rank 0 is leaving)")
                return
            self.inbox += data
            if len(self.inbox) == self.need:
                message, self.inbox = bytes(self.inbox), bytearray()
                self._step(message)
            return
        data = sock.recv(65536)
        other, out = (self.b, self.to_b) if sock is self.a else (self.a, self.to_a)
        out += data
        if sock is self.a:
            self.eof_a = not data
        else:
            self.eof_b = not data
        if self.state != "splice":
            if self.eof_a:  # torch's client left before the handshake ended
                self.close()
        elif out and other is not None:  # pass it on now: one wake-up per hop, not two
            with contextlib.suppress(BlockingIOError):
                del out[:other.send(out)]

    def _step(self, message: bytes) -> None:
        """A handshake message arrived whole: check it, and answer."""
        key, guard = self.guard.key, self.guard
        if self.state == "hello":
            if not hmac.compare_digest(message[:len(MAGIC)], MAGIC):
                self.fail("not a phalanx guard's hello")
                return
            nc, ns = message[len(MAGIC):], os.urandom(NONCE)
            self.expected = _mac(key, b"phalanx guard client", nc, ns)
            self.hs_out += MAGIC + ns + _mac(key, b"phalanx guard server", nc, ns)
            self.state, self.need = "proof", PROOF
        elif self.state == "proof":
            if not hmac.compare_digest(message, self.expected):
                self.fail("wrong proof")
                return
            try:
                self.b = socket.create_connection(("127.0.0.1", guard.store_port), timeout=1.0)
            except OSError:  # the store is gone: rank 0 is shutting down
                self.close()
                return
            _quick(self.b)
            self.to_a += ACCEPT
            self.state = "splice"
        elif self.state == "challenge":
            nc, ns = self.nc, message[len(MAGIC):len(MAGIC) + NONCE]
            if not (hmac.compare_digest(message[:len(MAGIC)], MAGIC) and hmac.compare_digest(
                    message[len(MAGIC) + NONCE:], _mac(key, b"phalanx guard server", nc, ns))):
                self.forged = True
                self.fail("it answered without proof of the secret: PHALANX_SECRET differs between ranks")
                return
            self.hs_out += _mac(key, b"phalanx guard client", nc, ns)
            self.state, self.need = "accept", len(ACCEPT)
        elif self.state == "accept":
            if not hmac.compare_digest(message, ACCEPT):
                self.forged = True
                self.fail("it did not accept the proof as a phalanx guard does")
                return
            self.state = "splice"  # torch's bytes held in to_b go out now

    # -- the client's connection to rank 0's guard ---------------------------------------
    def connect(self) -> None:
        """Start (or retry) the connection to rank 0's guard."""
        self.tries += 1
        self.b = socket.socket(self.guard.family, socket.SOCK_STREAM)
        _quick(self.b)
        self.state = "connect"
        code = self.b.connect_ex(self.guard.upstream)
        if code not in (0, errno.EINPROGRESS, errno.EWOULDBLOCK):
            self._retry(os.strerror(code))

    def _connected(self) -> None:
        assert self.b is not None
        code = self.b.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
        if code:
            self._retry(os.strerror(code))
            return
        self.nc = os.urandom(NONCE)
        self.hs_out += MAGIC + self.nc
        self.state, self.need = "challenge", CHALLENGE
        self.deadline = min(self.deadline, time.monotonic() + HANDSHAKE_S)

    def _retry(self, why: str) -> None:
        """rank 0 is not listening yet (or no longer): try again a little later, until the deadline."""
        self.guard.unreachable = f"could not connect to rank 0's guard at {self.guard.where} ({why})"
        self.guard.drop(self.b)
        self.b = None
        self.state = "retry"
        self.inbox, self.hs_out = bytearray(), bytearray()
        self.retry_at = time.monotonic() + min(0.002 * 2 ** min(self.tries, 7), 0.25)

    # -- ends -------------------------------------------------------------------------
    def tick(self, now: float) -> None:
        if self.state == "retry" and now >= self.retry_at and now < self.deadline:
            self.connect()
        elif self.state != "splice" and now >= self.deadline:
            self.fail("no handshake within the deadline" if self.guard.serving or self.state != "retry"
                      else "")

    def fail(self, why: str) -> None:
        if self.closed:
            return
        if self.guard.serving and self.state != "splice":
            self.guard.refused(self.peer)
        elif self.state == "challenge" and not self.forged and time.monotonic() < self.guard.until:
            # Closed or silent before proving anything (rank 0 busy or restarting, a full guard):
            # no verdict on the secret; try again until the rendezvous' deadline.
            self._retry(why or "no handshake within the deadline")
            self.deadline = self.guard.until
            return
        elif why and self.state in ("challenge", "accept"):  # for good: retrying cannot change the secret
            self.guard.refusal = self.guard.refusal or f"rank 0's guard at {self.guard.where}: {why}"
        self.close()

    def close(self) -> None:
        self.closed = True
        for sock in (self.a, self.b):
            self.guard.drop(sock)


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
        self.refusal: str | None = None     # a client whose handshake failed: why (kept for good)
        self.unreachable: str | None = None  # why the last connection to rank 0's guard failed
        self.refusals = 0
        self._selector = selectors.DefaultSelector()
        self._listeners: list[socket.socket] = []
        self._links: list[_Link] = []
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
        link = _Link(self, sock, peer)
        self._links.append(link)
        if not self.serving:
            link.connect()

    def _watch(self, link: _Link) -> None:
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

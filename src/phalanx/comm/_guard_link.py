"""One guarded connection: phalanx's handshake on a socket, then its bytes copied both ways.

The handshake that :class:`~._guard.Guard` runs on every connection before it
carries store bytes; both sides prove that they hold the job's secret
(``PHALANX_SECRET``)::

    client -> server  HELLO      b"PHXG\\x01" + Nc                    (37 bytes)
    server -> client  CHALLENGE  b"PHXG\\x01" + Ns + HMAC(K, "phalanx guard server" + Nc + Ns)   (69 bytes)
    client -> server  PROOF      HMAC(K, "phalanx guard client" + Nc + Ns)   (32 bytes)
    server -> client  ACCEPT     b"\\x01"                               (1 byte)

``Nc``/``Ns`` are 32 random bytes each (``os.urandom``), ``K`` the secret's
UTF-8 bytes, HMAC is HMAC-SHA256 and every comparison is constant-time
(``hmac.compare_digest``). Every message has a fixed size and the server reads
exactly that many bytes; a connection that has not finished within
:data:`HANDSHAKE_S` is closed.

:class:`Link` is one connection's state machine, driven by its guard's thread:
on rank 0 (serving) it answers a client's hello on the accepted socket, then
splices it to the store on loopback; on the other ranks it connects to rank
0's guard (retrying while rank 0 is not up yet), proves the secret, then
splices torch's connection to it. What a link needs of its guard is
:class:`Owner`.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import hmac
import os
import selectors
import socket
import time
from typing import Any, Protocol

__all__ = ["ACCEPT", "CHALLENGE", "HANDSHAKE_S", "HELLO", "MAGIC", "NONCE", "PROOF", "Link", "Owner"]

MAGIC = b"PHXG\x01"
NONCE = 32
HELLO = len(MAGIC) + NONCE
CHALLENGE = len(MAGIC) + NONCE + 32
PROOF = 32
ACCEPT = b"\x01"
HANDSHAKE_S = 5.0   # a connection must have proved the secret this soon after it was made
_BUFFER = 1 << 20   # bytes held per direction before the guard stops reading that side
_R, _W = selectors.EVENT_READ, selectors.EVENT_WRITE


def _mac(key: bytes, label: bytes, nc: bytes, ns: bytes) -> bytes:
    return hmac.new(key, label + nc + ns, hashlib.sha256).digest()


def _quick(sock: socket.socket) -> None:
    """Non-blocking, and small writes sent at once: a store request forwarded in pieces must not
    wait for the peer's delayed acknowledgement (Nagle's algorithm)."""
    sock.setblocking(False)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


class Owner(Protocol):
    """What a :class:`Link` reads and calls on its guard (:class:`~._guard.Guard`)."""

    key: bytes             # the job's secret
    serving: bool          # rank 0's guard (answers hellos) or a rank's (connects to rank 0's)
    store_port: int        # serving: the store's loopback port
    upstream: Any          # client: rank 0's guard's socket address
    family: socket.AddressFamily
    where: str             # client: rank 0's guard as ``host:port``, for messages
    until: float           # client: monotonic deadline of the rendezvous
    silence_s: float       # client: a connection whose sent bytes go unacknowledged this long is dropped
    refusal: str | None
    unreachable: str | None

    def refused(self, peer: str) -> None: ...

    def drop(self, sock: socket.socket | None) -> None: ...


class Link:
    """One guarded connection: the handshake on one socket, then bytes copied both ways."""

    def __init__(self, guard: Owner, a: socket.socket, peer: str) -> None:
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
        if hasattr(socket, "TCP_USER_TIMEOUT"):  # Linux: a peer behind a partition fails the store's call,
            # as a closed connection would, instead of leaving it to wait on TCP's retransmissions (minutes)
            self.b.setsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT, max(1000, int(self.guard.silence_s * 1000)))
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

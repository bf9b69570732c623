"""Programs for tests/test_rendezvous_hosts.py, run as scripts (on this host or on simulated hosts).

``python program_rendezvous.py rank OUT BODY``: one gloo rank (the launch variables come from the
environment the test sets); it leaves ``OUT/up<rank>.json`` once the world is up (or
``OUT/error<rank>.json`` if ``init`` raised) and ``OUT/done<rank>.json`` after ``shutdown``.
``python program_rendezvous.py intruder HOST PORT``: tries the rendezvous at HOST:PORT without the
job's secret (a raw socket, torch's own store client, a guard with a wrong secret) and prints
what happened to each, as JSON.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import sys
import time
from datetime import timedelta
from typing import Any

INTRUDER_KEYS = ["intruder/torch", "intruder/wrong-secret"]


def listening() -> list[list[Any]]:
    """[address, port] of each listening TCP socket of this process."""
    import psutil

    return sorted([c.laddr.ip, c.laddr.port] for c in psutil.Process().net_connections("tcp")
                  if c.status == psutil.CONN_LISTEN)


def _write(path: str, data: dict[str, Any]) -> None:
    with open(path + ".tmp", "w") as f:
        json.dump(data, f)
    os.replace(path + ".tmp", path)


def _wait_for(path: str, limit: float = 60.0) -> None:
    deadline = time.monotonic() + limit
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            raise SystemExit(f"{path} never appeared")
        time.sleep(0.05)


def rank(out: str, body: str) -> None:
    import numpy as np
    import torch  # noqa: F401  (imported first: init's time is the rendezvous's, not torch's import)

    import phalanx

    me = int(os.environ["RANK"])
    start = time.perf_counter()
    try:
        phalanx.init(backend="gloo")
    except phalanx.PhalanxError as exc:
        _write(f"{out}/error{me}.json", {"error": f"{type(exc).__name__}: {exc}",
                                         "after_s": time.perf_counter() - start})
        raise SystemExit(3) from None
    init_s = time.perf_counter() - start
    total = float(phalanx.allreduce(np.array([me + 1.0]))[0])
    _write(f"{out}/up{me}.json", {"init_s": init_s, "sum": total, "listening": listening(),
                                  "iface": os.environ.get("GLOO_SOCKET_IFNAME")})
    if body == "world":
        _wait_for(f"{out}/go")
        if me == 0:  # what the intruders tried to write
            store = phalanx._world.current("test").backend._store
            present = [k for k in INTRUDER_KEYS if store.check([k])]
            del store  # a reference held here would keep torch's store serving after shutdown
        phalanx.barrier()
    else:
        present = _timeout(me, body)
    phalanx.shutdown()
    _write(f"{out}/done{me}.json", {"listening": listening(), "intruder_keys": present if me == 0 else []})


def _timeout(me: int, body: str) -> list[str]:
    """The last rank sleeps (``diag``) or rank 0 stops dead (``stop``); the others time out in an
    allreduce and leave the error's text and how long it took."""
    import numpy as np

    import phalanx

    last = phalanx.size() - 1
    phalanx.barrier()
    if (body == "diag" and me == last) or (body == "stop" and me == 0):
        if body == "stop":
            os.kill(os.getpid(), signal.SIGSTOP)
        time.sleep(20)
        return []
    start = time.monotonic()
    try:
        phalanx.allreduce(np.ones(4))
    except phalanx.CollectiveTimeoutError as exc:
        _write(f"{os.environ['RDV_OUT']}/timeout{me}.json", {"error": str(exc), "after_s": time.monotonic() - start})
    return []


def _raw(host: str, port: int, payload: bytes) -> str:
    """What the rendezvous does with a plain socket that sends ``payload``: closed (after how long)."""
    start = time.monotonic()
    with socket.create_connection((host, port), timeout=10) as sock:
        if payload:
            sock.sendall(payload)
        try:
            data = sock.recv(4096)
        except ConnectionResetError:
            data = b""
        except TimeoutError:
            return "still open after 10 s"
    return (f"answered {data[:16]!r}" if data else "closed") + f" after {time.monotonic() - start:.2f} s"


def intruder(host: str, port: int) -> dict[str, str]:
    from torch.distributed import TCPStore

    from phalanx.comm._guard import Guard

    found = {"raw": _raw(host, port, b"\0" * 64), "silent": _raw(host, port, b"")}
    try:
        store = TCPStore(host, port, None, False, timedelta(seconds=3), wait_for_workers=False)
        store.set(INTRUDER_KEYS[0], b"x")
        found["torch"] = "set a key"
    except RuntimeError as exc:
        found["torch"] = f"failed: {str(exc).splitlines()[0][:200]}"
    guard = Guard.client(host, port, b"not the job's secret, but long", 3.0)
    try:
        store = TCPStore("127.0.0.1", guard.port, None, False, timedelta(seconds=3), wait_for_workers=False)
        store.set(INTRUDER_KEYS[1], b"x")
        found["wrong-secret"] = "set a key"
    except RuntimeError as exc:
        found["wrong-secret"] = f"failed: {guard.failure or str(exc).splitlines()[0][:200]}"
    finally:
        guard.close()
    return found


if __name__ == "__main__":
    if sys.argv[1] == "rank":
        os.environ["RDV_OUT"] = sys.argv[2]
        rank(sys.argv[2], sys.argv[3])
    else:
        print(json.dumps(intruder(sys.argv[2], int(sys.argv[3]))), flush=True)

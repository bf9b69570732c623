"""The rank program of the host-failure tests, started by ``phalanx run``: ``python program_host_failures.py MODE``.

``loop``: 16 MB float32 allreduces until a fault ends the job; every rank prints
``ITER i`` as it goes and, when a phalanx error reaches it, ``RAISED <unix time>
<type>: <message>`` before letting the error end the rank as any uncaught error does.
``few N``: N 16 MB allreduces, each result checked, then ``DONE``.
"""

from __future__ import annotations

import socket
import sys
import time

import numpy as np

import phalanx

MB16 = 4 << 20  # float32 elements in 16 MB


def _say(text: str) -> None:
    sys.stdout.write(text + "\n")  # one write per line: ranks share the launcher's console
    sys.stdout.flush()


def loop() -> None:
    r = phalanx.rank()
    buf = np.ones(MB16, np.float32)
    i = 0
    try:
        while True:
            phalanx.allreduce(buf)
            i += 1
            _say(f"ITER {i} rank={r} host={socket.gethostname()}")
    except phalanx.PhalanxError as exc:
        _say(f"RAISED {time.time():.3f} rank={r} {type(exc).__name__}: {str(exc)[:300]}")
        raise


def few(n: int) -> None:
    r, size = phalanx.rank(), phalanx.size()
    for i in range(n):
        start = time.monotonic()
        total = phalanx.allreduce(np.full(MB16, float(r + 1), np.float32))
        expected = size * (size + 1) / 2
        assert total[0] == expected and total[-1] == expected, f"allreduce {i} gave {total[0]}, not {expected}"
        _say(f"ITER {i + 1} rank={r} took={time.monotonic() - start:.2f}")
    _say(f"DONE rank={r}")


if __name__ == "__main__":
    phalanx.init()
    if sys.argv[1] == "loop":
        loop()
    else:
        few(int(sys.argv[2]))
    phalanx.shutdown()

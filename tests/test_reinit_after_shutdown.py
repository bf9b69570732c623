"""A gloo world shut down and started again at once: rank 0's rendezvous port is closed after
``shutdown()``, and peers that leave first never join the previous world's store while rank 0 is
still releasing it (they wait for the new world's, bounded); three re-inits, no wait out of a timeout.

And the process group's own threads end at ``shutdown()``, even after a torch optimizer was made
while the group existed (that imports ``torch._dynamo``, which imports ``torch.distributed.nn``:
imported then, its functions' ``group=group.WORLD`` defaults would keep the group, and its threads,
alive until interpreter exit, where they can abort the process)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time

import pytest

from conftest import AVAILABLE

pytestmark = pytest.mark.skipif("gloo" not in AVAILABLE, reason="needs the gloo backend")

SCRIPT = textwrap.dedent('''
    import glob, os, socket, time
    import numpy as np
    import phalanx
    from phalanx._world import current

    def group_threads():
        names = []
        for comm in glob.glob("/proc/self/task/*/comm"):
            try:
                with open(comm) as f:
                    names.append(f.read().strip())
            except OSError:  # a thread that ended meanwhile
                pass
        return sorted(n for n in names if n.startswith(("gloo", "pt_gloo", "pt_tcpstore")))

    for round in range(3):
        phalanx.init(timeout=20)
        assert phalanx.allreduce(np.ones(2))[0] == phalanx.size()
        rank = phalanx.rank()
        if round == 0:
            import torch
            torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=0.1)  # imports torch._dynamo
            assert group_threads(), "the test looks for threads that gloo no longer names so"
        if rank == 0:  # rank 0 releases its store last: the peers are in the next init by then
            current("test").on_shutdown(lambda: time.sleep(1.0))
        phalanx.shutdown()
        if os.path.isdir("/proc/self/task") and group_threads():
            raise SystemExit(f"round {round}: the process group's threads outlive shutdown(): {group_threads()}")
        if rank == 0:
            with socket.socket() as s:
                s.settimeout(2)
                try:
                    s.connect((os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])))
                except OSError:
                    pass
                else:
                    raise SystemExit(f"round {round}: the rendezvous port is still open after shutdown()")
    print("reinit-ok", phalanx.__name__, flush=True)
''')


def test_gloo_reinit_right_after_shutdown_port_closed_no_stale_store_and_group_threads_gone(tmp_path):
    script = tmp_path / "reinit.py"
    script.write_text(SCRIPT)
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "phalanx", "run", "-n", "3", "--backend", "gloo", str(script)],
                          env=dict(os.environ, OMP_NUM_THREADS="1"), capture_output=True, text=True, timeout=120)
    took = time.monotonic() - start
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert proc.stdout.count("reinit-ok") == 3, proc.stdout
    assert took < 60, f"took {took:.0f} s: a rank waited out a timeout"

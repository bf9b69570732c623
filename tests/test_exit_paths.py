"""How a `phalanx run` job ends when its scripts do what most scripts do.

Real jobs on mpi and gloo: a rank that returns from its script without
``phalanx.shutdown()`` has left (its peers' ``shutdown()`` agrees with it at
once); an abnormal end leaves none of the job's MPICH shared-memory segments
behind.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from conftest import AVAILABLE

LAUNCHERS = [pytest.param(b, marks=[] if b in AVAILABLE else pytest.mark.skip(reason=f"no {b} backend here"))
             for b in ("mpi", "gloo")]


def _run(tmp_path: Path, body: str, *options: str, n: int = 2,
         timeout: float = 60) -> tuple[subprocess.CompletedProcess[str], float]:
    job = tmp_path / "job.py"
    job.write_text(textwrap.dedent(body))
    start = time.monotonic()
    out = subprocess.run([sys.executable, "-m", "phalanx", "run", "-n", str(n), *options, str(job)],
                         capture_output=True, text=True, timeout=timeout, env=dict(os.environ))
    return out, time.monotonic() - start


ONLY_RANK_0_SHUTS_DOWN = """\
    import phalanx
    phalanx.init()
    phalanx.allreduce(1.0)
    if phalanx.rank() == 0:
        phalanx.shutdown()  # the others just return from the script
    print("done", phalanx.rank() if phalanx.initialized() else 0, flush=True)
"""


@pytest.mark.parametrize("timeout", [["--timeout", "5"], []], ids=["timeout-5", "default-timeout"])
@pytest.mark.parametrize("backend", LAUNCHERS)
def test_a_rank_exiting_without_shutdown_counts_as_its_shutdown(tmp_path: Path, backend: str,
                                                               timeout: list[str]) -> None:
    out, elapsed = _run(tmp_path, ONLY_RANK_0_SHUTS_DOWN, "--backend", backend, *timeout, n=3)
    print(f"\n{backend} {' '.join(timeout) or 'default timeout'}: the job ended with {out.returncode} "
          f"after {elapsed:.1f} s")
    assert out.returncode == 0, out.stderr
    assert elapsed < 15, f"the job took {elapsed:.1f} s to end\n{out.stderr}"
    assert "Error" not in out.stderr and "Warning" not in out.stderr, out.stderr


KILLED_RANK = """\
    import glob, os, signal, time
    import phalanx
    phalanx.init()
    phalanx.allreduce(1.0)
    if phalanx.rank() == 0:
        maps = open(f"/proc/{os.getpid()}/maps").read().splitlines()
        print("SEGMENTS", *sorted({l.split()[-1] for l in maps if "/dev/shm/mpich_shm_" in l
                                    and not l.endswith("(deleted)")}), flush=True)
    phalanx.barrier()
    if phalanx.rank() == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(30)
"""


def _mpich() -> bool:
    """Whether the mpiexec beside this Python is MPICH's (asked without initializing MPI here)."""
    import shutil

    from phalanx.launch._mpi_flavor import mpiexec_flavor

    mpiexec = shutil.which("mpiexec", path=os.path.dirname(sys.executable)) or shutil.which("mpiexec")
    return mpiexec is not None and mpiexec_flavor(mpiexec).family == "mpich"


@pytest.mark.skipif("mpi" not in AVAILABLE or not _mpich(),
                    reason="MPICH's shared-memory segments (/dev/shm/mpich_shm_*): needs MPICH")
def test_an_abnormal_mpi_end_removes_the_jobs_shared_memory_segments_only(tmp_path: Path) -> None:
    other = Path("/dev/shm/mpich_shm_0phalanxtest_0")  # another job's segment: never touched
    other.write_bytes(b"x")
    try:
        out, elapsed = _run(tmp_path, KILLED_RANK, "--backend", "mpi", "--timeout", "10")
        segments = [s for line in out.stdout.splitlines() if line.startswith("SEGMENTS")
                    for s in line.split()[1:]]
        print(f"\nthe job ended with {out.returncode} after {elapsed:.1f} s; its segments: {segments}")
        assert out.returncode != 0 and "rank 1" in out.stderr and "SIGKILL" in out.stderr, out.stderr
        assert segments, out.stdout
        assert not [s for s in segments if os.path.exists(s)], segments
        assert other.exists()
    finally:
        other.unlink(missing_ok=True)


@pytest.mark.skipif("gloo" not in AVAILABLE, reason="no gloo backend here")
def test_a_rank_aborted_by_gloo_is_reported_with_what_gloo_said_and_what_it_means(tmp_path: Path) -> None:
    out, elapsed = _run(tmp_path, """\
        import torch, torch.distributed as dist
        import phalanx
        phalanx.init()
        dist.all_reduce(torch.zeros(2 if phalanx.rank() == 0 else 222))  # a mismatch gloo cannot survive
    """, "--backend", "gloo", "--timeout", "10")
    print(f"\nthe job ended with {out.returncode} after {elapsed:.1f} s")
    report = out.stderr[out.stderr.index("phalanx run: rank"):]
    assert out.returncode != 0 and "SIGABRT" in report, out.stderr
    assert "gloo aborted rank" in report and "op.preamble.length <= op.nbytes" in report, report
    assert "the ranks made different collective calls" in report, report

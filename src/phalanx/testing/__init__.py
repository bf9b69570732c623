"""Run a function on every rank of a fresh world, for tests.

::

    import numpy as np
    import phalanx
    from phalanx.testing import WorldFailed, available_backends, run_world

    def total_of_ranks():                 # module level: each rank imports it from this file
        return phalanx.allreduce(np.array([phalanx.rank()]))[0]

    def test_allreduce():
        assert run_world(total_of_ranks, n=3, backend="mpi") == [3, 3, 3]

    def fail_on_rank_1():
        if phalanx.rank() == 1:
            raise ValueError("boom")
        phalanx.barrier()

    def test_failure_is_reported():
        with pytest.raises(WorldFailed) as failed:
            run_world(fail_on_rank_1, n=2, backend="gloo", op_timeout=5)
        assert "ValueError: boom" in failed.value.outputs[1]

Each world is started the way users start theirs (``phalanx run``: mpiexec
for ``"mpi"``, the spawning launcher for ``"gloo"``/``"nccl"``; ``"local"``
is one plain process), every rank calls ``phalanx.init(backend)`` and then
``fn(*args)``, and the ranks' return values come back pickled, in rank order.
``fn`` must be a module-level function of an importable file: the ranks find
it by ``inspect.getfile(fn)`` and ``fn.__qualname__`` and import that file
under the same module name, so classes it defines unpickle on both sides.

Any failure (a non-zero exit, or the hard ``timeout`` passing, after which
the whole process tree is killed) raises :class:`WorldFailed` with the
launcher's report and every rank's complete output.

Simulated hosts
---------------

:func:`simulated_hosts` builds ``k`` Linux hosts on this machine (network
namespaces behind one switch; root needed) for tests of multi-host jobs::

    import subprocess, sys
    from phalanx.testing import simulated_hosts

    def test_allreduce_on_two_hosts():
        with simulated_hosts(2, rate="1gbit") as hosts:   # h0, h1: 198.18.0.1 and .2 on eth0
            job = hosts.run(0, ["mpiexec", "-launcher", "ssh", "-launcher-exec", hosts.rsh,
                                "-hosts", "h0:1,h1:1", sys.executable, "job.py"], timeout=60)
            assert job.returncode == 0
            hosts.cut(1)        # h1's link goes down (hosts.heal(1) brings it back)
            hosts.kill(1)       # every process on h1 dies
        # here no process, namespace or file of the hosts is left, even if the body raised

Host ``i`` is named ``hI`` (resolvable on every host) and has its own address,
host name, IPC namespace, ``/dev/shm`` and ``TMPDIR``; the rest of the file
system is shared, as an NFS home would be. ``hosts.run``/``hosts.popen`` run a
command on a host like ``subprocess``; ``hosts.rsh`` is an ssh stand-in
(``RSH [ssh options] HOST COMMAND...``: the words joined and run by ``sh -c``
with ssh's minimal environment) for ``mpiexec -launcher-exec``, Open MPI's
``--mca plm_rsh_agent`` or ``phalanx run --rsh``. ``hosts.set_rate`` shapes
bandwidth; delay and loss are not simulated. Where hosts cannot be built (not
root, not Linux), entering raises ``SimulatedHostsUnavailableError`` saying why:
skip such tests there.
"""

from __future__ import annotations

import functools
import importlib.util
import inspect
import json
import os
import pickle
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from .._errors import InvalidArgumentError, UnsupportedArgumentError
from ..launch._call import MAIN_ALIAS, missing_results, results, write_call
from ..launch._job import worker_command
from ..launch._mpi_flavor import find_mpiexec
from ..launch._procs import descendants, kill_pids
from ._hosts import SimulatedHosts, simulated_hosts

__all__ = ["SimulatedHosts", "WorldFailed", "available_backends", "run_world", "simulated_hosts"]

_STOP_GRACE = 5.0  # after the hard timeout: how long the launcher gets to stop its ranks itself


class WorldFailed(AssertionError):
    """Raised by :func:`run_world` when a world failed, timed out or a rank returned nothing.

    An ``AssertionError``, so a test that calls ``run_world`` fails (not errors) with the
    message: what went wrong, the launcher's report, then every rank's output.

    Attributes:
        ``returncode``: the launcher's exit status (``None`` after the hard timeout).
        ``timed_out``: whether the hard ``timeout`` of ``run_world`` passed.
        ``outputs``: rank -> that rank's complete stdout and stderr.
        ``report``: what the launcher printed (its failure report naming the first failing rank).
        ``elapsed``: seconds from start to end.
    """

    def __init__(self, message: str, *, returncode: int | None, outputs: dict[int, str], report: str,
                 elapsed: float, timed_out: bool = False) -> None:
        super().__init__(message)
        self.returncode = returncode
        self.outputs = outputs
        self.report = report
        self.elapsed = elapsed
        self.timed_out = timed_out


@functools.lru_cache(maxsize=1)
def available_backends() -> list[str]:
    """The backends :func:`run_world` can start on this machine, e.g. ``["local", "mpi", "gloo"]``.

    ``"local"`` always; ``"mpi"`` when mpi4py and an ``mpiexec`` are installed; ``"gloo"``
    when the installed torch ships torch.distributed; ``"nccl"`` when torch was built with NCCL
    and a CUDA GPU is visible. Imports neither torch nor mpi4py for the first three (the nccl
    answer imports torch only when ``nvidia-smi`` or ``/dev/nvidia0`` says a GPU may be there).
    """
    found = ["local"]
    if importlib.util.find_spec("mpi4py") is not None and find_mpiexec() is not None:
        found.append("mpi")
    if importlib.util.find_spec("phalanx.comm._torch") is not None and _gloo_available():
        found.append("gloo")
        if _nccl_available():
            found.append("nccl")
    return found


def _nccl_available() -> bool:
    """Whether torch has NCCL and sees a CUDA GPU. torch is imported only where a GPU may be (an
    NVIDIA device node or ``nvidia-smi``), so CPU machines keep this check free."""
    if "torch" not in sys.modules and not (os.path.exists("/dev/nvidia0") or shutil.which("nvidia-smi")):
        return False
    import torch
    import torch.distributed as dist

    return bool(dist.is_available() and dist.is_nccl_available() and torch.cuda.is_available())


def _gloo_available() -> bool:
    """torch.distributed's answer when torch is loaded; else, without paying seconds to import
    torch, whether the installed torch ships torch.distributed (every Linux/macOS wheel has gloo)."""
    if "torch" in sys.modules:
        import torch.distributed as dist

        return dist.is_available() and dist.is_gloo_available()
    spec = importlib.util.find_spec("torch")
    return spec is not None and any(os.path.isfile(os.path.join(where, "distributed", "__init__.py"))
                                    for where in spec.submodule_search_locations or [])


def run_world(fn: Callable[..., Any], n: int = 2, backend: str = "mpi", *, timeout: float = 60.0,
              op_timeout: float | None = None, args: Sequence[Any] = (),
              env: Mapping[str, str] | None = None) -> list[Any]:
    """Run ``fn(*args)`` on each of ``n`` fresh ranks and return their return values in rank order.

    The world is started as users start theirs (mpiexec for ``"mpi"``, the spawning launcher
    for ``"gloo"``/``"nccl"``, one plain process for ``"local"``); every rank calls
    ``phalanx.init(backend)``, then ``fn(*args)``, and its return value comes back pickled.

    What runs:
        ``fn``: a function defined at module level in an importable file (each rank imports
        that file under the same module name, so classes it defines unpickle on both sides).
        ``args``: its positional arguments (pickled). ``env``: extra environment variables
        for every rank.

    The world:
        ``n``: number of ranks (``1`` for ``"local"``). ``backend``: ``"local"``, ``"mpi"``,
        ``"gloo"`` or ``"nccl"``. ``op_timeout``: ``phalanx.init(timeout=...)`` on every
        rank, the seconds a collective may wait.

    Limits:
        ``timeout``: hard limit in seconds for the whole world, start-up included; after
        it every process of the world is killed.

    Returns:
        ``[value of rank 0, value of rank 1, ...]``.

    Raises:
        :class:`WorldFailed` (an ``AssertionError``) when a rank fails, the world times out
        or a rank returns nothing, with the launcher's report and every rank's output.
        :class:`~phalanx.InvalidArgumentError` for a bad ``n``/``backend``;
        :class:`~phalanx.UnsupportedArgumentError` for an ``fn`` the ranks cannot import.
    """
    _check_world(n, backend)
    call = _locate(fn)
    call.update(backend=backend, op_timeout=op_timeout, sys_path=[p for p in sys.path if p])
    if call["module"] == "__main__":
        sys.modules.setdefault(MAIN_ALIAS, sys.modules["__main__"])  # results from the ranks name it
    tmp = tempfile.mkdtemp(prefix="phalanx-world-")
    try:
        write_call(tmp, call, pickle.dumps(tuple(args), protocol=pickle.HIGHEST_PROTOCOL))
        logs = os.path.join(tmp, "logs")
        full_env = dict(os.environ, PHALANX_BACKEND=backend, PYTHONUNBUFFERED="1", **(env or {}))
        returncode, report, elapsed, timed_out = _run(_world_command(n, backend, tmp, logs), full_env, timeout)
        if backend == "local":
            outputs, report = {0: report}, ""
        else:
            outputs = {r: _read(os.path.join(logs, f"rank.{r}.log")) for r in range(n)}
        returned = results(tmp, n) if returncode == 0 else None
        if returned is not None:
            return returned
        if timed_out:
            what = f"did not finish within timeout={timeout:g} s; every process was killed"
        elif returncode == 0:
            missing = missing_results(tmp, n)
            what = f"exited 0 but ranks {missing} returned no value (did fn call sys.exit or os._exit?)"
        else:
            what = f"failed with exit status {returncode} after {elapsed:.1f} s"
        raise WorldFailed(_message(fn, n, backend, what, report, outputs), returncode=None if timed_out else
                          returncode, outputs=outputs, report=report, elapsed=elapsed, timed_out=timed_out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _check_world(n: int, backend: str) -> None:
    if backend not in ("local", "mpi", "gloo", "nccl"):
        raise InvalidArgumentError(f"phalanx.testing.run_world(backend={backend!r}): unknown backend; use "
                                   "'local', 'mpi', 'gloo' or 'nccl' (available_backends() lists those here).")
    if not isinstance(n, int) or n < 1:
        raise InvalidArgumentError(f"phalanx.testing.run_world(n={n!r}): a world needs at least one rank; "
                                   "pass n=1 or more.")
    if backend == "local" and n != 1:
        raise InvalidArgumentError(f"phalanx.testing.run_world(n={n}, backend='local'): a local world has "
                                   "exactly one rank; use n=1, or backend='mpi' or 'gloo' for more.")


def _world_command(n: int, backend: str, call_dir: str, logs: str) -> list[str]:
    """The local rank itself, or the launcher (``python -m phalanx.launch``) starting ``n`` ranks."""
    target = ["-m", "phalanx.launch._call", call_dir]
    if backend == "local":
        return worker_command(target)
    job = {"n": n, "backend": backend, "target": target, "log_dir": logs, "echo": False}
    return [sys.executable, "-m", "phalanx.launch", json.dumps(job)]


def _locate(fn: Callable[..., Any]) -> dict[str, Any]:
    qualname = getattr(fn, "__qualname__", None)
    if not callable(fn) or not qualname or "<" in qualname:
        raise UnsupportedArgumentError(
            f"phalanx.testing.run_world(fn={fn!r}): fn must be a function defined at module level (not a "
            "lambda or a nested function), so that every rank can import it; move it to the top of a file.")
    try:
        path = os.path.abspath(inspect.getfile(fn))
    except TypeError:
        raise UnsupportedArgumentError(
            f"phalanx.testing.run_world(fn={fn!r}): fn must be defined in a file (not in an interactive "
            "session), so that every rank can import it; put it in a module.") from None
    return {"file": path, "module": fn.__module__, "qualname": qualname}


def _run(cmd: list[str], env: dict[str, str], timeout: float) -> tuple[int | None, str, float, bool]:
    """(exit status, combined output, seconds, timed out); on timeout nothing started survives."""
    start = time.monotonic()
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
        return proc.returncode, out.decode(errors="replace"), time.monotonic() - start, False
    except subprocess.TimeoutExpired:
        tree = descendants(proc.pid)
        proc.send_signal(signal.SIGTERM)  # the launcher stops its ranks and reports
        try:
            out, _ = proc.communicate(timeout=_STOP_GRACE)
        except subprocess.TimeoutExpired:
            tree += descendants(proc.pid)
            kill_pids([*tree, proc.pid])
            out, _ = proc.communicate()
        kill_pids(tree)  # anything that outlived the launcher (spawned ranks have their own sessions)
        return None, out.decode(errors="replace"), time.monotonic() - start, True
    except BaseException:  # Ctrl-C in the test run: take the world down with it
        kill_pids([*descendants(proc.pid), proc.pid])
        proc.wait()
        raise


def _read(path: str) -> str:
    try:
        with open(path, "rb") as f:
            return f.read().decode(errors="replace")
    except OSError:
        return "(no output file)\n"


def _message(fn: Callable[..., Any], n: int, backend: str, what: str, report: str,
             outputs: dict[int, str]) -> str:
    parts = [f"run_world({getattr(fn, '__qualname__', fn)}, n={n}, backend={backend!r}) {what}."]
    if report.strip():
        parts.append(f"--- launcher ---\n{report.rstrip()}")
    for rank, text in sorted(outputs.items()):
        parts.append(f"--- rank {rank} output ---\n{text.rstrip() or '(nothing)'}")
    return "\n".join(parts)

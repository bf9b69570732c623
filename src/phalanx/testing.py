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

__all__ = ["WorldFailed", "available_backends", "run_world"]

_STOP_GRACE = 5.0  # after the hard timeout: how long the launcher gets to stop its ranks itself


class WorldFailed(AssertionError):
    """A world started by :func:`run_world` failed or timed out.

    ``returncode``: the launcher's exit status (``None`` after a timeout);
    ``outputs``: rank -> that rank's complete stdout+stderr; ``report``: what
    the launcher printed (its failure report); ``elapsed``: seconds.
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
    """Backends :func:`run_world` can use here: ``local`` always; ``mpi`` with mpi4py and an
    mpiexec; ``gloo`` when torch.distributed has it."""
    from .cli._mpiexec import find_mpiexec

    found = ["local"]
    if importlib.util.find_spec("mpi4py") is not None and find_mpiexec() is not None:
        found.append("mpi")
    if importlib.util.find_spec("phalanx.comm._torch") is not None and _gloo_available():
        found.append("gloo")
    return found


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
    """``fn(*args)`` on each of ``n`` fresh ranks; returns their return values in rank order.

    ``backend``: ``"local"`` (``n`` must be 1), ``"mpi"``, ``"gloo"`` or ``"nccl"``.
    ``timeout``: hard limit in seconds for the whole world, start-up included.
    ``op_timeout``: ``phalanx.init(timeout=...)`` on every rank (how long a
    collective may wait). ``env``: extra environment variables for the ranks.
    Raises :class:`WorldFailed` (an ``AssertionError``) when anything fails.
    """
    if backend not in ("local", "mpi", "gloo", "nccl"):
        raise ValueError(f"run_world(backend={backend!r}): use 'local', 'mpi', 'gloo' or 'nccl'")
    if backend == "local" and n != 1:
        raise ValueError(f"run_world(n={n}, backend='local'): a local world has exactly one rank; use n=1")
    if n < 1:
        raise ValueError(f"run_world(n={n}): a world needs at least one rank")
    call = _locate(fn)
    call.update(backend=backend, op_timeout=op_timeout, sys_path=[p for p in sys.path if p])
    if call["module"] == "__main__":
        from .cli._call import MAIN_ALIAS

        sys.modules.setdefault(MAIN_ALIAS, sys.modules["__main__"])  # results from the ranks name it

    tmp = tempfile.mkdtemp(prefix="phalanx-world-")
    try:
        with open(os.path.join(tmp, "call.json"), "w") as f:
            json.dump(call, f)
        with open(os.path.join(tmp, "args.pkl"), "wb") as f:
            pickle.dump(tuple(args), f, protocol=pickle.HIGHEST_PROTOCOL)
        logs = os.path.join(tmp, "logs")
        child = [sys.executable, "-m", "phalanx.cli._worker", "-m", "phalanx.cli._call", tmp]
        if backend == "local":
            cmd = child
        else:
            cmd = [sys.executable, "-m", "phalanx", "run", "-n", str(n), "--backend", backend,
                   "--log-dir", logs, "--no-echo", *child[3:]]
        full_env = dict(os.environ, PHALANX_BACKEND=backend, PYTHONUNBUFFERED="1", **(env or {}))
        returncode, report, elapsed, timed_out = _run(cmd, full_env, timeout)
        if backend == "local":
            outputs, report = {0: report}, ""
        else:
            outputs = {r: _read(os.path.join(logs, f"rank.{r}.log")) for r in range(n)}
        results = [os.path.join(tmp, f"result-rank{r}.pkl") for r in range(n)]
        if returncode == 0 and all(os.path.exists(p) for p in results):
            values = []
            for path in results:
                with open(path, "rb") as f:
                    values.append(pickle.load(f))
            return values
        if timed_out:
            what = f"did not finish within timeout={timeout:g} s; every process was killed"
        elif returncode == 0:
            missing = [r for r, p in enumerate(results) if not os.path.exists(p)]
            what = f"exited 0 but ranks {missing} returned no value (did fn call sys.exit or os._exit?)"
        else:
            what = f"failed with exit status {returncode} after {elapsed:.1f} s"
        raise WorldFailed(_message(fn, n, backend, what, report, outputs), returncode=None if timed_out else
                          returncode, outputs=outputs, report=report, elapsed=elapsed, timed_out=timed_out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _locate(fn: Callable[..., Any]) -> dict[str, Any]:
    qualname = getattr(fn, "__qualname__", None)
    if not callable(fn) or not qualname or "<" in qualname:
        raise TypeError(f"run_world(fn={fn!r}): fn must be a function defined at module level (not a "
                        "lambda or a nested function), so that every rank can import it")
    try:
        path = os.path.abspath(inspect.getfile(fn))
    except TypeError:
        raise TypeError(f"run_world(fn={fn!r}): fn must be defined in a file (not in an interactive "
                        "session), so that every rank can import it") from None
    return {"file": path, "module": fn.__module__, "qualname": qualname}


def _run(cmd: list[str], env: dict[str, str], timeout: float) -> tuple[int | None, str, float, bool]:
    """(exit status, combined output, seconds, timed out); on timeout nothing started survives."""
    from .cli._procs import descendants, kill_pids

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

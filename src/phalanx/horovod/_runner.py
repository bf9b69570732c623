"""``phalanx.horovod.run``: a function on N ranks, through ``phalanx run``'s launcher.

The driver writes the function and its arguments into a call directory
(:mod:`phalanx.launch._call`'s protocol; cloudpickle when installed, so lambdas
and closures travel; else pickle, by reference to an importable module-level
function), builds the job from the same flags ``phalanx run`` takes, and starts
every rank as ``python -m phalanx.horovod._runner CALL_DIR``. Each rank runs the
function and leaves ``result-rank<r>.pkl``, or ``error-rank<r>.json`` with its
traceback, then re-raises so that the launcher ends the job as usual. The
call directory lives in the temporary directory when every rank runs here,
and in the working directory when hosts are given (it must then be on a file
system every host shares).
"""

from __future__ import annotations

import json
import os
import pickle
import shutil
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Sequence
from typing import Any

from .._errors import JobFailedError
from .._files import write_atomically
from ..launch._call import leave_result, load_call, missing_results, results
from ..launch._call import write_call as _write_call

__all__ = ["collect", "main", "write_call"]

try:
    import cloudpickle as _pickler  # functions by value: lambdas, closures, a script's __main__
except ImportError:  # pragma: no cover - depends on the environment
    _pickler = None


def _reference(fn: Callable[..., Any]) -> dict[str, Any]:
    """Where a module-level function lives (for ranks that import it instead of unpickling it)."""
    import inspect

    qualname = getattr(fn, "__qualname__", "")
    try:
        path = os.path.abspath(inspect.getfile(fn))
    except TypeError:
        path = ""
    if not qualname or "<" in qualname or not path:
        from .._errors import UnsupportedArgumentError

        raise UnsupportedArgumentError(
            f"phalanx.horovod.run(func={fn!r}): without cloudpickle the function must be defined at module "
            "level of a file (not a lambda or nested function); `pip install cloudpickle` or move it.")
    return {"file": path, "module": fn.__module__, "qualname": qualname}


def write_call(call_dir: str, fn: Callable[..., Any], args: Sequence[Any], kwargs: dict[str, Any]) -> None:
    """Write ``fn(*args, **kwargs)`` into ``call_dir`` for the ranks."""
    call: dict[str, Any] = {"sys_path": [p for p in sys.path if p], "cwd": os.getcwd()}
    if _pickler is not None:
        payload = _pickler.dumps((fn, tuple(args), dict(kwargs)), protocol=pickle.HIGHEST_PROTOCOL)
    else:
        call.update(_reference(fn))
        payload = pickle.dumps((None, tuple(args), dict(kwargs)), protocol=pickle.HIGHEST_PROTOCOL)
    _write_call(call_dir, call, payload)


def call_dir_for(remote: bool) -> str:
    """A fresh call directory: in the working directory when ranks run on other hosts."""
    return tempfile.mkdtemp(prefix=".phalanx-run-" if remote else "phalanx-run-",
                            dir=os.getcwd() if remote else None)


def collect(call_dir: str, n: int, code: int, what: str) -> list[Any]:
    """The ranks' results in rank order, or JobFailedError naming the first rank that failed."""
    returned = results(call_dir, n) if code == 0 else None
    if returned is not None:
        return returned
    errors = []
    for r in range(n):
        try:
            with open(os.path.join(call_dir, f"error-rank{r}.json")) as f:
                errors.append(json.load(f))
        except (OSError, ValueError):
            continue
    if errors:
        first = min(errors, key=lambda e: e["time"])
        others = sorted(e["rank"] for e in errors if e is not first)
        also = f" (ranks {others} raised too)" if others else ""
        message = (f"{what}: rank {first['rank']} raised {first['type']}: {first['message']}{also}; the job "
                   f"was stopped (exit status {code}). Its traceback:\n{first['traceback'].rstrip()}")
    elif code == 0:
        missing = missing_results(call_dir, n)
        message = (f"{what}: ranks {missing} returned no result (did the function call sys.exit or os._exit?); "
                   "every rank must return from it.")
    else:
        message = (f"{what}: the job failed with exit status {code} before the function returned on every "
                   "rank (a rank died or could not start); the launcher's report above names the rank.")
    raise JobFailedError(message, returncode=code)


def remove(call_dir: str) -> None:
    shutil.rmtree(call_dir, ignore_errors=True)


# -- on every rank ------------------------------------------------------------------------------
def _load(call_dir: str) -> tuple[Callable[..., Any], tuple[Any, ...], dict[str, Any]]:
    _, fn, (loaded, args, kwargs) = load_call(call_dir)
    return (fn if fn is not None else loaded), args, kwargs


def main(call_dir: str) -> None:
    """Run the call in ``call_dir`` on this rank and leave its result (or error) there."""
    from .._failure import env_rank

    rank = env_rank()
    try:
        fn, args, kwargs = _load(call_dir)
        result = fn(*args, **kwargs)
    except BaseException as exc:
        tb = exc.__traceback__  # from the user's function on: this runner's own frame left out
        tb = (tb.tb_next or tb) if tb is not None else None
        record = {"rank": rank, "time": time.time(), "type": type(exc).__name__, "message": str(exc)[:2000],
                  "traceback": "".join(traceback.format_exception(type(exc), exc, tb))[-20000:]}
        with write_atomically(os.path.join(call_dir, f"error-rank{rank}.json"), "w", durable=False) as f:
            json.dump(record, f)
        raise
    leave_result(call_dir, rank, result, (_pickler or pickle).dump)  # cloudpickle: classes by value too
    import phalanx

    if phalanx.initialized():
        phalanx.shutdown()  # every rank leaves together, as Horovod's shutdown at exit does


if __name__ == "__main__":
    main(sys.argv[1])

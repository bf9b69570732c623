"""The call directory: how a driver runs one function on every rank, and one rank of it.

Two drivers use it: :func:`phalanx.testing.run_world` (each rank runs
``python -m phalanx.launch._call CALL_DIR``, :func:`main` below) and
:func:`phalanx.horovod.run` (``python -m phalanx.horovod._runner CALL_DIR``).

* ``CALL_DIR/call.json`` (:data:`CALL_FILE`): the driver's ``sys_path``, and where
  the function lives when the ranks import it (``file``, ``module``, ``qualname``),
  plus what the driver adds (run_world: the backend and ``op_timeout``).
* ``CALL_DIR/args.pkl`` (:data:`ARGS_FILE`): the pickled arguments (run_world: the
  tuple of positional arguments; horovod.run: ``(function or None, args, kwargs)``).
* ``CALL_DIR/result-rank<r>.pkl``: what rank ``r`` returned, whole or absent, never half.

A rank imports the function's file under the *same* module name as in the
driver, so classes in the arguments and the return value unpickle on both
sides (a script's ``__main__`` as :data:`MAIN_ALIAS`, without running its main
block). Here :func:`main` calls ``phalanx.init``, runs the function and leaves
its result; an exception propagates to the worker bootstrap, which reports it
and ends the world.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import os
import pickle
import sys
from collections.abc import Callable
from types import ModuleType
from typing import Any

from .._errors import LaunchError
from .._files import write_atomically

__all__ = ["ARGS_FILE", "CALL_FILE", "MAIN_ALIAS", "leave_result", "load_call", "load_module", "main", "missing_results",
           "result_path", "results", "write_call"]

MAIN_ALIAS = "__phalanx_main__"  # a test script's __main__, imported without running its main block
CALL_FILE, ARGS_FILE = "call.json", "args.pkl"


def load_module(path: str, name: str) -> ModuleType:
    """The module ``name`` defined by file ``path``: importable as usual, or loaded from the file."""
    if name == "__main__":
        name = MAIN_ALIAS
    module = sys.modules.get(name)
    if module is not None and _same(getattr(module, "__file__", None), path):
        return module
    if name != MAIN_ALIAS:
        try:
            spec = importlib.util.find_spec(name)
        except (ImportError, ValueError):
            spec = None
        if spec is not None and _same(spec.origin, path):
            return importlib.import_module(name)
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise LaunchError(f"phalanx.testing.run_world: cannot import {path} as module {name!r}; fn must be "
                          "defined in an importable Python file.")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def _same(a: str | None, b: str) -> bool:
    try:
        return a is not None and os.path.samefile(a, b)
    except OSError:
        return False


def resolve(module: ModuleType, qualname: str) -> Any:
    obj: Any = module
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return obj


def write_call(call_dir: str, call: dict[str, Any], args: bytes) -> None:
    """Write ``call`` (``sys_path`` and, for ranks that import the function, ``file``, ``module``,
    ``qualname``) and the pickled ``args`` into ``call_dir``, for the ranks' :func:`load_call`."""
    with open(os.path.join(call_dir, CALL_FILE), "w") as f:
        json.dump(call, f)
    with open(os.path.join(call_dir, ARGS_FILE), "wb") as f:
        f.write(args)


def load_call(call_dir: str) -> tuple[dict[str, Any], Any, Any]:
    """On a rank: ``(call.json, the function it names or None, the unpickled args.pkl)``.

    The driver's ``sys_path`` is added first and the function's module imported before the
    arguments are unpickled, so that classes defined there (or in the driver's ``__main__``) resolve.
    """
    with open(os.path.join(call_dir, CALL_FILE)) as f:
        call = json.load(f)
    sys.path.extend(p for p in call["sys_path"] if p not in sys.path)
    fn = None
    if call.get("qualname"):
        module = load_module(call["file"], call["module"])
        if call["module"] == "__main__":
            sys.modules["__main__"] = module  # arguments pickled from the driver's __main__ find their classes
        fn = resolve(module, call["qualname"])
    with open(os.path.join(call_dir, ARGS_FILE), "rb") as f:
        args = pickle.load(f)  # noqa: S301 - written by this job's driver
    return call, fn, args


def result_path(call_dir: str, rank: int) -> str:
    return os.path.join(call_dir, f"result-rank{rank}.pkl")


def leave_result(call_dir: str, rank: int, result: Any, dump: Callable[..., None] = pickle.dump) -> None:
    """Leave this rank's ``result`` for the driver: whole or absent, never half (the driver reads it
    once the launcher is done). ``dump``: e.g. ``cloudpickle.dump`` (classes by value)."""
    with write_atomically(result_path(call_dir, rank), durable=False) as f:
        dump(result, f, protocol=pickle.HIGHEST_PROTOCOL)


def missing_results(call_dir: str, n: int) -> list[int]:
    """The ranks among ``0..n-1`` that left no result."""
    return [r for r in range(n) if not os.path.exists(result_path(call_dir, r))]


def results(call_dir: str, n: int) -> list[Any] | None:
    """The results of ranks ``0..n-1`` in rank order, or None when a rank left none."""
    if missing_results(call_dir, n):
        return None
    found = []
    for rank in range(n):
        with open(result_path(call_dir, rank), "rb") as f:
            found.append(pickle.load(f))  # noqa: S301 - written by this job's own ranks
    return found


def main(call_dir: str) -> None:
    """One rank of :func:`phalanx.testing.run_world`: init, run the function, leave its result."""
    call, fn, args = load_call(call_dir)

    import phalanx

    if call["op_timeout"] is None:
        phalanx.init(call["backend"])
    else:
        phalanx.init(call["backend"], timeout=call["op_timeout"])
    result = fn(*args)
    leave_result(call_dir, phalanx.rank(), result)
    phalanx.shutdown()


if __name__ == "__main__":
    main(sys.argv[1])

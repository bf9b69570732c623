"""One rank of :func:`phalanx.testing.run_world`: ``python -m phalanx.launch._call CALL_DIR``.

``CALL_DIR/call.json`` says where the function lives (file, module name,
qualified name) and how to start phalanx; ``CALL_DIR/args.pkl`` holds its
arguments. The rank imports the file under the *same* module name as in the
test process, so classes in the return value unpickle there, calls
``phalanx.init``, runs the function and pickles what it returns into
``CALL_DIR/result-rank<r>.pkl``. An exception propagates to the worker
bootstrap, which reports it and ends the world.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import os
import pickle
import sys
from types import ModuleType
from typing import Any

from .._errors import LaunchError
from .._files import write_atomically

__all__ = ["MAIN_ALIAS", "load_module", "main"]

MAIN_ALIAS = "__phalanx_main__"  # a test script's __main__, imported without running its main block


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


def main(call_dir: str) -> None:
    with open(os.path.join(call_dir, "call.json")) as f:
        call = json.load(f)
    sys.path.extend(p for p in call["sys_path"] if p not in sys.path)
    module = load_module(call["file"], call["module"])
    if call["module"] == "__main__":
        sys.modules["__main__"] = module  # arguments pickled from the test's __main__ find their classes
    fn = resolve(module, call["qualname"])
    with open(os.path.join(call_dir, "args.pkl"), "rb") as f:
        args = pickle.load(f)

    import phalanx

    if call["op_timeout"] is None:
        phalanx.init(call["backend"])
    else:
        phalanx.init(call["backend"], timeout=call["op_timeout"])
    result = fn(*args)
    # Whole or absent, never half (the test process reads it once the launcher is done).
    with write_atomically(os.path.join(call_dir, f"result-rank{phalanx.rank()}.pkl"), durable=False) as f:
        pickle.dump(result, f, protocol=pickle.HIGHEST_PROTOCOL)
    phalanx.shutdown()


if __name__ == "__main__":
    main(sys.argv[1])

"""Sharded checkpoints (``save_sharded``/``load_sharded``/``export_safetensors``): written at N ranks, read at another.

The write world (N ranks) saves a ``shard="parameters"`` GPT and keeps the
uninterrupted result; the read world (another N) loads it under each
``shard`` level and unwrapped, and continues to the same result.
"""

from __future__ import annotations

import pytest

import worlds_sharded_checkpoint as bodies
from conftest import world_params

SIZES = [("local", 1, 1), ("mpi", 2, 3), ("gloo", 3, 2)]
_DIRS: dict[str, str] = {}


@pytest.mark.parametrize("phase,behaviour", [("write", b) for b in bodies.WRITE.names]
                         + [("read", b) for b in bodies.READ.names])
@pytest.mark.parametrize("backend,written_at,read_at", [
    pytest.param(b, w, r, id=f"{b}-{w}-{r}", marks=world_params([(b, w)])[0].marks) for b, w, r in SIZES])
def test_sharded_checkpoint(worlds, tmp_path_factory, backend: str, written_at: int, read_at: int, phase: str,
                            behaviour: str) -> None:
    if backend not in _DIRS:
        _DIRS[backend] = str(tmp_path_factory.mktemp(f"sharded-{backend}"))
    directory = _DIRS[backend]
    written = behaviour if phase == "write" else bodies.WRITE.names[0]
    worlds.check(bodies.checkpoints, backend, written_at, written, timeout=180, op_timeout=60,
                 args=(directory, "write"))
    if phase == "read":
        worlds.check(bodies.checkpoints, backend, read_at, behaviour, timeout=180, op_timeout=60,
                     args=(directory, "read"))

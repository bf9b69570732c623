"""A rank's extra collective fails alone: the Horovod layer's rule for a mismatched blocking call.

phalanx's core matches collectives by call order and, when the ranks' calls differ,
raises on every rank (nothing was sent). Horovod matches operations by name: an
operation that one rank submits and the others never do fails (or stalls) only
there, while the others' operations go on. A test that fails its assertion on two
ranks of three, while the third passes and makes one more collective, shows the
difference: with the core's rule the others' next call (in the next test) fails too,
and every later call after it, each rank one call apart.

:func:`majority_retries` is the world's ``retry_mismatch`` while ``hvd`` runs. On a
mismatch every rank also tells which ``hvd`` operation it is in (the public function,
or ``name=`` when given: Horovod's matching key). When more than half of the ranks
made exactly the same call (call, step, buffer, op, root) in the same operation, and
every other rank is in a different operation, those others raise as before and the
majority makes its call again, to be matched with the others' next call. Ranks in the
same operation (different dtypes, shapes or roots under one name, or one operation
taking different paths on different ranks) all raise, as Horovod's mismatch errors
do; so does every rank when any of them is outside a ``hvd`` operation, in a
non-blocking call or in ``hvd.join``'s exchange; with two ranks there is no majority.
"""

from __future__ import annotations

import json
from typing import Any

__all__: list[str] = []

_FIELDS = ("call", "step", "buffer", "op", "root")
current: list[str | None] = [None]  # the outermost hvd operation this rank is in (set by _errmap)


def operation_key(call: str, kwargs: dict[str, Any]) -> str:
    """What identifies a ``hvd`` operation across ranks: its ``name=`` when given, else its function."""
    name = kwargs.get("name")
    return f"name:{name}" if isinstance(name, str) else call


JOIN_STEP = 0x4A4F494E  # "JOIN": the step label of hvd.join's exchanges (named in the mismatch they cause)


def _key(entry: dict[str, Any]) -> str:
    return json.dumps([entry.get(k) for k in _FIELDS])


def majority_retries(world: Any, entries: list[dict[str, Any]], can_retry: bool) -> bool:
    """Whether this rank makes its mismatched call again (see the module docstring); called on every
    rank of ``world`` with every rank's description (``entries``), it exchanges each rank's operation."""
    if any(e.get("step") == JOIN_STEP for e in entries):  # hvd.join's protocol: every rank sees the mismatch
        return False
    me = world.rank
    ops = world.allgather_json(entries[me]["call"], [current[0], can_retry])
    mine = ops[me]
    if mine[0] is None or any(op[0] is None for op in ops):
        return False
    alike = [r for r, op in enumerate(ops) if op[0] == mine[0] and _key(entries[r]) == _key(entries[me])]
    others = [r for r, op in enumerate(ops) if op[0] != mine[0]]
    return (2 * len(alike) > len(entries) and len(alike) + len(others) == len(entries)
            and all(ops[r][1] for r in alike))

"""A user's own loop that re-forms in place (tests/test_recovery.py): what ``phalanx.reform()`` does.

3 ranks under ``phalanx run --backend gloo --min-ranks 1``; the rank 2 of epoch 0 is SIGKILLed at
iteration 5. The survivors catch the RankFailedError, find their pre-failure handle refused, re-form
(epoch 1 of 2 ranks: the ``on_reform`` callback, then a registered object, run in the new world) and continue; each writes what it saw to ``MARKS/reform-<pid>.json``. Under
``--max-restarts 1`` the launcher also starts a replacement: at a later iteration
``phalanx.replacement_waiting()`` is True on every rank, they re-form to admit it (epoch 2 of 3), and
it receives the iteration count from rank 0, as a survivor does after each re-formation.
"""

from __future__ import annotations

import json
import os
import signal
import time

import numpy as np

import phalanx
from phalanx import _reconfigure

phalanx.init(elastic=True)  # this loop re-forms itself: the launcher keeps the survivors
MARKS = os.environ["MARKS"]
SLOW = os.environ.get("SLOW") == "1"
seen: dict[str, object] = {"start": [phalanx.epoch(), phalanx.rank(), phalanx.size()], "callbacks": []}
phalanx.on_reform(lambda epoch: seen["callbacks"].append([epoch.number, epoch.rank, epoch.size]))  # type: ignore[union-attr]


class Follower:
    """An object that follows each re-formed world through the recovery contract (``phalanx._reconfigure``):
    rebound in the same loop as the callback registered before it, after it (it notes how many ran)."""

    def rebind(self, epoch: phalanx._epochs.Epoch) -> None:
        seen.setdefault("followed", []).append(  # type: ignore[union-attr]
            [epoch.number, epoch.rank, epoch.size, len(seen["callbacks"])])  # type: ignore[arg-type]

    def state_dict(self) -> dict[str, object]:
        return {}

    def load_state_dict(self, state: dict[str, object]) -> None:
        return None


follower = Follower()
_reconfigure.register(follower)
_reconfigure.register(Follower())  # held weakly, collected at once: never rebound
JOINING = os.environ.get("PHALANX_JOINING") == "1"  # a replacement: it starts in the epoch that admits it
# made in epoch 0 (a collective the replacement, which joins later, does not make): refused once the world re-forms
group = phalanx.new_group([0, 1]) if not JOINING else None
stale = None
i, synced = 0, False
while True:
    try:
        if not synced:  # at the start and after each re-formation: a survivor's count (a replacement starts at 0)
            i = int(phalanx.broadcast(np.array([i]), root=0)[0])
            synced = True
        if i >= 20:
            break
        if phalanx.replacement_waiting():  # collective: every rank learns rank 0's answer
            epoch = phalanx.reform("admitting a replacement")
            seen.setdefault("admitted", []).append([epoch.number, epoch.size, list(epoch.joined), i])
            synced = False
            continue
        if i == 5 and phalanx.epoch() == 0 and phalanx.size() == 3:
            stale = phalanx.iallreduce(np.ones(3))  # posted in epoch 0: refused once it re-forms
            if phalanx.rank() == 2:
                os.kill(os.getpid(), signal.SIGKILL)
        if SLOW and phalanx.size() < 3:
            time.sleep(0.5)  # short-handed iterations are slow: the replacement has time to start and join
        total = phalanx.allreduce(np.array([1.0]))
        assert total[0] == phalanx.size(), (total, phalanx.size())
        i += 1
    except phalanx.RankFailedError as exc:
        seen["error"] = type(exc).__name__
        seen["error_mentions_reform"] = "phalanx.reform()" in str(exc)
        epoch = phalanx.reform()
        synced = False
        seen["epoch"] = {"number": epoch.number, "rank": epoch.rank, "size": epoch.size, "lost": list(epoch.lost),
                         "joined": list(epoch.joined), "previous_rank": epoch.previous_rank}
        try:
            stale.wait()  # type: ignore[union-attr]
            seen["stale"] = "completed"
        except phalanx.PhalanxError as refused:
            seen["stale"] = f"{type(refused).__name__}: {str(refused).splitlines()[0]}"
        try:
            phalanx.allreduce(np.ones(1), group=group) if group is not None else None
            seen["old_group"] = "used"
        except phalanx.PhalanxError as refused:
            seen["old_group"] = f"{type(refused).__name__}: {str(refused).splitlines()[0]}"
seen["end"] = [phalanx.epoch(), phalanx.rank(), phalanx.size(), i]
seen.setdefault("followed", [])
seen["joined_late"] = JOINING
with open(os.path.join(MARKS, f"reform-{os.getpid()}.json"), "w") as f:
    json.dump(seen, f)

"""Sub-worlds (``phalanx.new_group``): every collective with ``group=`` on worlds of 1, 2 and 3 ranks.

* every collective on the groups of even ranks, odd ranks and all ranks (``[0, 2]``, ``[1]``,
  ``[0, 1, 2]`` at 3 ranks) against NumPy, roots counted as group ranks;
* disjoint groups used concurrently, groups interleaved with world calls, nested groups;
* a non-member's call, a root outside the group, a mismatch inside a group (members only),
  different or invalid ranks for ``new_group``, a destroyed group: each a phalanx error;
* ``DistributedOptimizer``/``DataParallel`` with ``group=`` reduce only in the group;
* a member that never comes: CollectiveTimeoutError naming it by world rank, in bounded time.
"""

from __future__ import annotations

import re
import time

import pytest

import worlds_groups as bodies
from conftest import MULTI_WORLDS, TRAINING_WORLDS, world_params
from phalanx.testing import WorldFailed, run_world

OP_TIMEOUT = 4.0
GRACE = 2.0 + 1.0  # the diagnosis' grace (at most 2 s) plus the second after which it is abandoned


@pytest.mark.parametrize("behaviour", bodies.GROUPS.names)
@pytest.mark.parametrize("backend,n", world_params(TRAINING_WORLDS + [("mpi", 3)]))  # MPI builds its own groups
def test_groups(worlds, backend: str, n: int, behaviour: str) -> None:
    worlds.check(bodies.groups, backend, n, behaviour, op_timeout=20.0, timeout=120)


@pytest.mark.parametrize("backend,n", world_params(MULTI_WORLDS))
def test_a_member_that_never_comes_times_out_naming_its_world_rank(backend: str, n: int) -> None:
    start = time.monotonic()
    with pytest.raises(WorldFailed) as failed:
        run_world(bodies.member_never_comes, n, backend, op_timeout=OP_TIMEOUT, timeout=90)
    elapsed = time.monotonic() - start
    report = str(failed.value)
    found = re.search(r"TIMES raised=(\d+\.\d+) \| missing=(\[[^\]]*\])", report)
    assert found, report
    raised, missing = float(found.group(1)), found.group(2)
    print(f"\n{backend}-{n}: rank 0 raised after {raised} s, the world ended after {elapsed:.1f} s")
    assert missing == f"[{n - 1}]", report
    assert "world after it: broken" in report, report  # a failure in a group ends the job as today
    assert f"in group [0, {n - 1}]" in report and f"(world rank {n - 1})" in report, report
    assert OP_TIMEOUT <= raised < OP_TIMEOUT + GRACE + 1.0, report
    assert elapsed < OP_TIMEOUT + GRACE + 30, report

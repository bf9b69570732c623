"""PowerSGD compression (``phalanx.torch.PowerSGD``, ``compression="powersgd"``) on real ranks (mpi, gloo; 1-3).

* exact where nothing is left out: at full rank (the average and the sum), for vectors and
  matrices too small to pay, and during warm-up; compressed matrices are low-rank;
* error feedback: the updates applied plus the errors the ranks carry equal the exact sum of the
  averaged gradients, step after step;
* the wrappers: DistributedOptimizer (passes per step), DataParallel (no_sync), fit; replicas
  stay identical; nonfinite="skip" leaves no NaN in the state; state_dict round trip;
* bad arguments raise InvalidArgumentError/UsageError naming the call;
* convergence: the digits MLP on 2 ranks reaches the uncompressed test accuracy within 0.5 points
  in the same number of epochs.
"""

from __future__ import annotations

import pytest

import worlds_powersgd as bodies
from conftest import TRAINING_WORLDS, world_params
from phalanx.testing import run_world

WORLD = {"timeout": 120, "op_timeout": 30}


@pytest.mark.parametrize("behaviour", bodies.POWERSGD.names)
@pytest.mark.parametrize("backend,n", world_params(TRAINING_WORLDS))
def test_powersgd(worlds, backend: str, n: int, behaviour: str) -> None:
    worlds.check(bodies.powersgd, backend, n, behaviour, **WORLD)


@pytest.mark.parametrize("backend,n", world_params([("gloo", 2), ("mpi", 2)]))
def test_powersgd_reaches_the_uncompressed_digits_accuracy_within_half_a_point(backend: str, n: int) -> None:
    pytest.importorskip("sklearn")
    results = run_world(bodies.digits_convergence, n, backend, **WORLD)
    assert results[0] == results[1], f"the ranks disagree: {results}"
    got = results[0]
    print(f"\n{backend}-{n}: test accuracy {got['plain']:.2f}% uncompressed, {got['powersgd']:.2f}% with "
          f"PowerSGD rank 4 ({got['bytes']} instead of {got['uncompressed']} bytes per step)")
    assert got["steps"] > 10, got
    assert got["powersgd"] >= got["plain"] - 0.5, got

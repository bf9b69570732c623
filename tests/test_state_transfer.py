"""A training state sent from one rank to every rank (``phalanx.train._state_transfer``: what a replacement
of ``fit(elastic=True)`` receives), on every size and backend."""

from __future__ import annotations

import pytest

import worlds_state_transfer as bodies
from conftest import TRAINING_WORLDS, world_params


@pytest.mark.parametrize("behaviour", bodies.STATE.names)
@pytest.mark.parametrize("backend,n", world_params(TRAINING_WORLDS))
def test_state_transfer(worlds, backend: str, n: int, behaviour: str) -> None:
    worlds.check(bodies.state_transfer, backend, n, behaviour)

"""``phalanx.train.fit`` on worlds of 1, 2 and 3 ranks equals a hand-written 1-process loop.

See ``worlds_fit`` for the bodies: equivalence (SGD, Adam, accumulation,
LR schedule, validation counting every sample once, replicas x processes),
the failure policy (NaN loss, out-of-memory in forward or backward on one
rank: skipped everywhere or a TrainingError everywhere), and checkpoints
(a SIGTERM on rank 0 stops every rank after the step with a checkpoint; the
resumed run, also at another world size, equals the uninterrupted one).
"""

from __future__ import annotations

import pytest

import worlds_fit as bodies
from conftest import ALL_WORLDS, AVAILABLE, world_params
from phalanx.testing import run_world


@pytest.mark.parametrize("backend,n", world_params(ALL_WORLDS))
def test_fit_equals_one_process_and_handles_failures_alike(backend: str, n: int, tmp_path) -> None:
    results = run_world(bodies.equivalence, n, backend, timeout=180, op_timeout=60, args=(str(tmp_path),))
    assert all(r == {"sgd": True, "adam": True, "sgd-accumulate": True, "DataParallel": True,
                     "DistributedOptimizer": True, "scheduler": True, "replicas": True}
               for r in results), results
    results = run_world(bodies.failures, n, backend, timeout=180, op_timeout=60, args=(str(tmp_path),))
    for r in results:
        assert r == {"nan": True, "oom": True, "oom-backward": True, "raise-nan": True, "raise-oom": True,
                     "max_skipped": True}, r


@pytest.mark.parametrize("backend,written_at,resumed_at", [
    pytest.param("local", 1, 1, id="local-1-1"),
    pytest.param("mpi", 2, 3, id="mpi-2-3", marks=pytest.mark.skipif("mpi" not in AVAILABLE, reason="no mpi")),
    pytest.param("gloo", 3, 2, id="gloo-3-2",
                 marks=pytest.mark.skipif("gloo" not in AVAILABLE, reason="no gloo")),
])
def test_sigterm_checkpoint_and_resume_equal_an_uninterrupted_run(backend: str, written_at: int,
                                                                  resumed_at: int, tmp_path) -> None:
    stopped = run_world(bodies.resume, written_at, backend, timeout=120, op_timeout=60,
                        args=(str(tmp_path), "write"))
    assert stopped[0]["stopped"] == "SIGTERM"
    assert all(r["stopped"] == "signal on another rank" for r in stopped[1:]), stopped
    resumed = run_world(bodies.resume, resumed_at, backend, timeout=120, op_timeout=60,
                        args=(str(tmp_path), "resume"))
    assert all(r == {"resumed": True} for r in resumed), resumed


def test_samples_are_seeded_by_seed_epoch_and_index_whoever_loads_them() -> None:
    # Random augmentation of a sample is the same whatever batch or worker fetches it, and the
    # training loop's own random streams are left where they were.
    import random

    import numpy as np
    import torch

    from phalanx.train._batches import SeededSamples

    class Augmented(torch.utils.data.Dataset):
        def __len__(self) -> int:
            return 10

        def __getitem__(self, i: int) -> tuple[float, float, float]:
            return float(torch.rand(())), float(np.random.rand()), random.random()

    data = SeededSamples(Augmented(), seed=3)
    torch.manual_seed(0)
    before = torch.get_rng_state()
    alone = data[(1, 4)]
    in_batch = data.__getitems__([(1, 2), (1, 4), (0, 4)])
    assert torch.equal(torch.get_rng_state(), before)
    assert in_batch[1] == alone  # same (epoch, index): same draws
    assert in_batch[2] != alone and in_batch[0] != alone  # another epoch or sample: other draws
    assert SeededSamples(Augmented(), seed=4)[(1, 4)] != alone

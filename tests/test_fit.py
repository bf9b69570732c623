"""``phalanx.train.fit`` on worlds of 1, 2 and 3 ranks equals a hand-written 1-process loop.

See ``worlds_fit`` for the bodies, one named behaviour per test id:
equivalence (SGD, Adam, accumulation, LR schedule, validation counting every
sample once, replicas x processes, a bitwise exact mid-epoch resume with
Dropout), the failure policy (NaN loss, NaN gradients with a finite loss,
out-of-memory in forward or backward on one rank: skipped everywhere or a
TrainingError everywhere naming the rank; a damaged newest checkpoint: every
rank falls back to the previous one), and checkpoints (a SIGTERM on rank 0
stops every rank after the step with a checkpoint; the resumed run, also at
another world size, equals the uninterrupted one).
"""

from __future__ import annotations

import pytest

import worlds_fit as bodies
from conftest import TRAINING_WORLDS, world_params
from phalanx import InvalidArgumentError


@pytest.mark.parametrize("behaviour", bodies.EQUIVALENCE.names)
@pytest.mark.parametrize("backend,n", world_params(TRAINING_WORLDS))
def test_fit_equals_one_process(worlds, tmp_path_factory, backend: str, n: int, behaviour: str) -> None:
    worlds.check(bodies.equivalence, backend, n, behaviour, timeout=240, op_timeout=60,
                 args=(_shared_dir(tmp_path_factory, "equivalence", backend, n),))


@pytest.mark.parametrize("behaviour", bodies.FAILURES.names)
@pytest.mark.parametrize("backend,n", world_params(TRAINING_WORLDS))
def test_failures_are_decided_alike_on_every_rank(worlds, tmp_path_factory, backend: str, n: int,
                                                  behaviour: str) -> None:
    worlds.check(bodies.failures, backend, n, behaviour, timeout=240, op_timeout=60,
                 args=(_shared_dir(tmp_path_factory, "failures", backend, n),))


def _shared_dir(factory: pytest.TempPathFactory, *key: object) -> str:
    """One directory per world (the world is shared by the tests of its behaviours)."""
    name = "-".join(map(str, key))
    if name not in _DIRS:
        _DIRS[name] = str(factory.mktemp(name))
    return _DIRS[name]


_DIRS: dict[str, str] = {}

RESUME_SIZES = [("local", 1, 1), ("mpi", 2, 3), ("gloo", 3, 2)]


@pytest.mark.parametrize("phase,behaviour", [("write", b) for b in bodies.RESUME_WRITE.names]
                         + [("resume", b) for b in bodies.RESUME_READ.names])
@pytest.mark.parametrize("backend,written_at,resumed_at", [
    pytest.param(b, w, r, id=f"{b}-{w}-{r}", marks=world_params([(b, w)])[0].marks) for b, w, r in RESUME_SIZES])
def test_sigterm_checkpoint_and_resume_equal_an_uninterrupted_run(worlds, tmp_path_factory, backend: str,
                                                                  written_at: int, resumed_at: int, phase: str,
                                                                  behaviour: str) -> None:
    directory = _shared_dir(tmp_path_factory, "resume", backend)
    written = behaviour if phase == "write" else bodies.RESUME_WRITE.names[0]
    worlds.check(bodies.resume, backend, written_at, written, timeout=120,
                 op_timeout=60, args=(directory, "write"))  # the resume needs the written checkpoint
    if phase == "resume":
        worlds.check(bodies.resume, backend, resumed_at, behaviour, timeout=120, op_timeout=60,
                     args=(directory, "resume"))


def test_fit_options_are_checked_before_anything_runs() -> None:
    import dataclasses

    from phalanx.train import FitOptions

    with pytest.raises(InvalidArgumentError, match=r"phalanx.train.fit\(batch_size=0\): give an int >= 1"):
        FitOptions(batch_size=0, steps=1)
    with pytest.raises(InvalidArgumentError, match=r"precision='fp8'\): use None, 'bf16' or 'fp16'"):
        FitOptions(batch_size=1, steps=1, precision="fp8")  # type: ignore[arg-type]
    with pytest.raises(InvalidArgumentError, match="give epochs= or steps="):
        FitOptions(batch_size=1)
    with pytest.raises(InvalidArgumentError, match="resume='latest'.*needs checkpoint_dir"):
        FitOptions(batch_size=1, steps=1, resume="latest")
    options = FitOptions(batch_size=8, epochs=2, topk=[1, 5])
    assert options.topk == (1, 5) and dataclasses.is_dataclass(options)
    with pytest.raises(dataclasses.FrozenInstanceError):
        options.batch_size = 4  # type: ignore[misc]
    with pytest.raises(TypeError):
        FitOptions(8, epochs=2)  # type: ignore[misc]  # keyword-only


def test_fit_takes_exactly_the_options_of_fit_options() -> None:
    # FitOptions declares the options; fit's keyword-only parameters are the same names, types and defaults.
    import dataclasses
    import inspect

    from phalanx.train import FitOptions, fit

    keywords = {p.name: (str(p.annotation), p.default) for p in inspect.signature(fit).parameters.values()
                if p.kind is inspect.Parameter.KEYWORD_ONLY}
    fields = {f.name: (str(f.type), f.default) for f in dataclasses.fields(FitOptions)}
    assert keywords == fields


def test_help_of_every_public_training_name_stands_alone() -> None:
    import inspect

    import phalanx.train as pt

    for name in pt.__all__:
        obj = getattr(pt, name)
        if not (inspect.isclass(obj) or inspect.isfunction(obj)):
            continue
        doc = inspect.getdoc(obj) or ""
        assert doc and "module docstring" not in doc and "see the docstring" not in doc.lower(), name
    fit_doc = inspect.getdoc(pt.fit)
    for group in ("Data:", "Optimisation:", "Precision:", "Checkpointing:", "Failure policy:", "Logging:",
                  "Returns:", "Raises:"):
        assert group in fit_doc, group
    missing = [p for p in inspect.signature(pt.fit).parameters if p not in fit_doc]
    assert not missing, missing


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

"""phalanx.synchronize: every kind of object on a world of one (local) and of 2 and 3 ranks per backend, plus the
tree helpers and the single-process rules in-process.

Each world runs the whole body in ``worlds_sync.synchronize_everything``: models, optimizers
(with and without state), schedulers, state dicts, tensors and arrays of many dtypes, scalars,
namedtuples and dataclasses, from root 0 and from the last rank; the number of broadcasts
(fusion); and mismatched structures, which must raise on every rank and leave the world usable.
Each behaviour is its own test id.
"""

from __future__ import annotations

import dataclasses
from collections import namedtuple

import numpy as np
import pytest

import phalanx
import worlds_sync as bodies
from conftest import AVAILABLE, TRAINING_WORLDS, world_params
from phalanx._tree import flatten, unflatten
from phalanx.testing import run_world


@pytest.mark.parametrize("behaviour", bodies.SYNC.names)
@pytest.mark.parametrize("backend,n", world_params(TRAINING_WORLDS))
def test_synchronize_every_kind_of_object(worlds, backend: str, n: int, behaviour: str) -> None:
    worlds.check(bodies.synchronize_everything, backend, n, behaviour, op_timeout=30)


@pytest.mark.parametrize("behaviour", bodies.MISMATCHES.names)
@pytest.mark.parametrize("backend,n", world_params([w for w in TRAINING_WORLDS if w[1] > 1]))
def test_synchronize_mismatches_raise_on_every_rank(worlds, backend: str, n: int, behaviour: str) -> None:
    worlds.check(bodies.synchronize_everything, backend, n, behaviour, op_timeout=30)  # the same world


# -- the tree helpers -------------------------------------------------------------------------------

Point = namedtuple("Point", "x y")


@dataclasses.dataclass
class Box:
    size: float
    label: str


@dataclasses.dataclass(frozen=True)
class Frozen:
    size: float


def test_flatten_names_paths_in_a_fixed_order() -> None:
    tree = {"b": [1, (2.0, Point(3, 4))], "a": Box(5.0, "x"), 7: None}
    leaves, _ = flatten(tree, path="obj")
    assert leaves == [("obj['b'][0]", 1), ("obj['b'][1][0]", 2.0), ("obj['b'][1][1].x", 3),
                      ("obj['b'][1][1].y", 4), ("obj['a'].size", 5.0), ("obj['a'].label", "x"),
                      ("obj[7]", None)]  # mixed key types: insertion order
    leaves, _ = flatten({"z": 1, "a": 2})
    assert [p for p, _ in leaves] == ["['a']", "['z']"], "sortable keys are visited sorted"


def test_unflatten_updates_mutables_in_place_and_rebuilds_immutables() -> None:
    inner = [1, 2]
    box, frozen, point = Box(1.0, "x"), Frozen(1.0), Point(1, 2)
    tree = {"list": inner, "tuple": (1, inner), "point": point, "box": box, "frozen": frozen}
    leaves, spec = flatten(tree)
    same = unflatten(spec, [v for _, v in leaves])
    assert same is tree and same["tuple"] is tree["tuple"] and same["point"] is point, "unchanged: same objects"
    values = [10 * v if isinstance(v, (int, float)) else v for _, v in leaves]
    out = unflatten(spec, values)
    assert out is tree and tree["list"] is inner and inner == [10, 20]
    assert tree["tuple"] == (10, [10, 20]) and tree["tuple"][1] is inner
    assert type(tree["point"]) is Point and tree["point"] == Point(10, 20) and point == Point(1, 2)
    assert tree["box"] is box and box.size == 10.0 and box.label == "x"
    assert tree["frozen"] == Frozen(10.0) and frozen == Frozen(1.0), "a frozen dataclass: a new one"
    with pytest.raises(ValueError, match="fewer values"):
        unflatten(spec, values[:-1])
    with pytest.raises(ValueError, match="more than"):
        unflatten(spec, [*values, 0])


def test_flatten_refuses_cycles() -> None:
    cycle: list = [1]
    cycle.append(cycle)
    with pytest.raises(ValueError, match="contains itself"):
        flatten(cycle, path="obj")


# -- single-process rules -----------------------------------------------------------------------------

def test_synchronize_needs_init() -> None:
    with pytest.raises(phalanx.NotInitializedError, match=r"phalanx.synchronize\(\) was called before"):
        phalanx.synchronize({"a": 1})


def test_synchronize_in_a_world_of_one_returns_the_same_objects() -> None:
    torch = pytest.importorskip("torch")
    phalanx.init("local")
    try:
        model = torch.nn.Linear(2, 2)
        tree = {"model": model, "n": 3, "t": (1.5, "x"), "a": np.ones(2)}
        out = phalanx.synchronize(tree)
        assert out is tree and out["t"] is tree["t"] and out["model"] is model
        assert phalanx.synchronize(4) == 4
        with pytest.raises(phalanx.UnsupportedArgumentError, match=r"obj\['big'\].*int64"):
            phalanx.synchronize({"big": 2**70})
        with pytest.raises(phalanx.UnsupportedArgumentError, match="forward pass"):
            phalanx.synchronize(torch.nn.LazyLinear(2))
        with pytest.raises(ValueError, match="root=1"):
            phalanx.synchronize(1, root=1)
    finally:
        phalanx.shutdown()


@pytest.mark.parametrize("backend,n", [("mpi", 1), ("mpi", 2), ("nccl", 1)])
def test_synchronize_cuda_tensors(backend: str, n: int) -> None:
    """CUDA parameters go in one GPU buffer, CPU leaves in one host buffer (skipped without a GPU)."""
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA GPU on this machine")
    if backend == "mpi" and "mpi" not in AVAILABLE:
        pytest.skip("no MPI here")
    results = run_world(bodies.synchronize_cuda, n, backend, op_timeout=60)
    assert all(res["broadcasts"] == (2 if n > 1 else 0) for res in results), results

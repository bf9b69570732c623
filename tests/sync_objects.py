"""Objects for the synchronize bodies (``worlds_sync``) and the checks of what synchronize leaves behind.

Every rank builds its objects from a seed equal to its rank, so the ranks
start out different, and every rank can rebuild root's objects from root's
seed to know what synchronize must leave behind. All values come from
elementwise arithmetic (no matmuls), so they are bit-identical across processes.
"""

from __future__ import annotations

import dataclasses
from collections import namedtuple
from typing import Any

import numpy as np

import phalanx

Pair = namedtuple("Pair", "first second")


@dataclasses.dataclass
class Config:
    lr: float
    steps: int
    name: str
    weights: Any


@dataclasses.dataclass(frozen=True)
class Frozen:
    scale: float
    flag: bool


def make_training(seed: int) -> tuple[Any, Any, Any, Any]:
    """(model, Adam after one step, its scheduler after seed+1 steps, SGD with empty state)."""
    import torch

    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4), torch.nn.Linear(4, 2))
    with torch.no_grad():
        for i, p in enumerate(model.parameters()):
            p.copy_(torch.arange(p.numel(), dtype=torch.float32).reshape(p.shape) * 0.01 + seed + i)
        model[1].running_mean.fill_(seed * 0.5)
        model[1].running_var.fill_(1.0 + seed)
        model[1].num_batches_tracked.fill_(10 * seed + 1)
    adam = torch.optim.Adam(model.parameters(), lr=0.01 * (seed + 1), betas=(0.9, 0.99 - seed * 0.001))
    for p in model.parameters():
        p.grad = torch.full_like(p, 0.1 * (seed + 1))
    adam.step()
    sched = torch.optim.lr_scheduler.StepLR(adam, step_size=2 + seed, gamma=0.5)
    for _ in range(seed + 1):
        adam.step()
        sched.step()
    sgd = torch.optim.SGD(model.parameters(), lr=0.1 * (seed + 1), momentum=0.9)
    return model, adam, sched, sgd


def make_tree(seed: int) -> dict[str, Any]:
    """Every kind of leaf and container synchronize handles, valued by ``seed``."""
    import torch

    s = float(seed)
    base = np.arange(12, dtype=np.float64).reshape(3, 4) + s
    frozen = np.full(3, s)
    frozen.setflags(write=False)
    return {
        "tensors": [torch.full((2, 3), s, dtype=dt) for dt in
                    (torch.float16, torch.bfloat16, torch.float64, torch.int32, torch.uint8)]
                   + [torch.tensor([seed % 2 == 0, True]), torch.full((2,), complex(s, -s)),
                      torch.tensor(s), torch.zeros(0) + s, (torch.arange(6.0) + s).reshape(2, 3).t()],
        "arrays": (np.full((2, 2), s, np.float32), np.arange(3, dtype=np.int16) + seed,
                   np.array([seed == 0, True]), base, base[:, ::2], frozen),
        "scalars": {"int": seed * 7, "float": s / 3, "bool": seed == 0, "np32": np.float32(s + 0.5),
                    "np64": np.int64(seed - 4), "big": 2**62 + seed},
        "pair": Pair(s, (seed, [s, "text"])),
        "config": Config(lr=s, steps=seed, name=f"rank-{seed}", weights=torch.full((2,), s)),
        "frozen": Frozen(scale=s, flag=seed % 2 == 1),
        "skipped": {"name": f"rank-{seed}", "nothing": None, "fn": print, "strings": np.array(["a"])},
    }


def equal(a: Any, b: Any, what: str) -> None:
    import torch

    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape, what
        assert torch.equal(a, b), f"{what}: {a} != {b}"
    elif isinstance(a, np.ndarray):
        assert isinstance(b, np.ndarray) and a.dtype == b.dtype, what
        assert np.array_equal(a, b), f"{what}: {a} != {b}"
    else:
        assert type(a) is type(b) and a == b, f"{what}: {a!r} ({type(a)}) != {b!r} ({type(b)})"


def check_training(got: tuple[Any, ...], want: tuple[Any, ...]) -> None:
    model, adam, sched, sgd = got
    ref_model, ref_adam, ref_sched, ref_sgd = want
    for (name, t), (_, ref) in zip(model.state_dict().items(), ref_model.state_dict().items(), strict=True):
        equal(t, ref, f"model {name}")
    sd, ref_sd = adam.state_dict(), ref_adam.state_dict()
    assert sd["state"].keys() == ref_sd["state"].keys()
    for i, state in sd["state"].items():
        for key, value in state.items():
            equal(value, ref_sd["state"][i][key], f"adam state[{i}][{key!r}]")
    for group, ref_group in zip(sd["param_groups"], ref_sd["param_groups"], strict=True):
        for key in ("lr", "betas", "eps", "initial_lr"):
            equal(group[key], ref_group[key], f"adam param_groups {key}")
    assert sched.state_dict() == ref_sched.state_dict(), (sched.state_dict(), ref_sched.state_dict())
    assert len(sgd.state) == 0, "an optimizer with empty state must stay empty (no dummy step)"
    equal(sgd.param_groups[0]["lr"], ref_sgd.param_groups[0]["lr"], "sgd lr")


def check_tree(got: dict[str, Any], original: dict[str, Any], root: int, r: int) -> None:
    """``got`` (synchronize's result) holds root's values; in-place leaves are ``original``'s objects."""
    want, mine = make_tree(root), make_tree(r)
    for i, (t, ref) in enumerate(zip(got["tensors"], want["tensors"], strict=True)):
        equal(t, ref, f"tensor {i}")
        assert t is original["tensors"][i], "tensors are updated in place"
    for i, (a, ref) in enumerate(zip(got["arrays"], want["arrays"], strict=True)):
        equal(a, ref, f"array {i}")
    arrays = original["arrays"]
    assert got["arrays"][0] is arrays[0] and got["arrays"][3] is arrays[3], "arrays are updated in place"
    assert got["arrays"][4].base is arrays[3], "a strided view is written through to its base"
    equal(arrays[5], mine["arrays"][5], "a read-only array is left alone")
    assert (got["arrays"][5] is arrays[5]) == (r == root), "a read-only array gets a new one"
    for key, value in want["scalars"].items():
        equal(got["scalars"][key], value, f"scalar {key}")
    assert got["scalars"] is original["scalars"], "dicts are updated in place"
    equal(got["pair"].first, want["pair"].first, "namedtuple field")
    assert type(got["pair"]) is Pair and got["pair"].second[0] == root and got["pair"].second[1][0] == root
    assert got["pair"].second[1][1] == "text"
    config = got["config"]
    assert config is original["config"], "a dataclass is updated in place"
    assert (config.lr, config.steps, config.name) == (float(root), root, f"rank-{r}"), config
    equal(config.weights, want["config"].weights, "dataclass tensor field")
    assert got["frozen"] == want["frozen"] and original["frozen"] == mine["frozen"], "frozen: a new one"
    skipped = got["skipped"]
    assert skipped["name"] == f"rank-{r}" and skipped["nothing"] is None and skipped["fn"] is print
    assert skipped["strings"].tolist() == ["a"]


def synchronized_tree(r: int, root: int) -> None:
    tree = make_tree(r)
    original = dict(tree)
    original["arrays"] = tuple(tree["arrays"])
    check_tree(phalanx.synchronize(tree, root=root), original, root, r)

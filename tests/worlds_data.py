"""Test bodies for synchronize, the data container and the sampler (run on every rank of a world).

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


def _equal(a: Any, b: Any, what: str) -> None:
    import torch

    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape, what
        assert torch.equal(a, b), f"{what}: {a} != {b}"
    elif isinstance(a, np.ndarray):
        assert isinstance(b, np.ndarray) and a.dtype == b.dtype, what
        assert np.array_equal(a, b), f"{what}: {a} != {b}"
    else:
        assert type(a) is type(b) and a == b, f"{what}: {a!r} ({type(a)}) != {b!r} ({type(b)})"


def _check_training(got: tuple[Any, ...], want: tuple[Any, ...]) -> int:
    model, adam, sched, sgd = got
    ref_model, ref_adam, ref_sched, ref_sgd = want
    checks = 0
    for (name, t), (_, ref) in zip(model.state_dict().items(), ref_model.state_dict().items(), strict=True):
        _equal(t, ref, f"model {name}")
        checks += 1
    sd, ref_sd = adam.state_dict(), ref_adam.state_dict()
    assert sd["state"].keys() == ref_sd["state"].keys()
    for i, state in sd["state"].items():
        for key, value in state.items():
            _equal(value, ref_sd["state"][i][key], f"adam state[{i}][{key!r}]")
            checks += 1
    for group, ref_group in zip(sd["param_groups"], ref_sd["param_groups"], strict=True):
        for key in ("lr", "betas", "eps", "initial_lr"):
            _equal(group[key], ref_group[key], f"adam param_groups {key}")
            checks += 1
    assert sched.state_dict() == ref_sched.state_dict(), (sched.state_dict(), ref_sched.state_dict())
    assert len(sgd.state) == 0, "an optimizer with empty state must stay empty (no dummy step)"
    _equal(sgd.param_groups[0]["lr"], ref_sgd.param_groups[0]["lr"], "sgd lr")
    return checks + 2


def _check_tree(got: dict[str, Any], original: dict[str, Any], root: int, r: int) -> int:
    """``got`` (synchronize's result) holds root's values; in-place leaves are ``original``'s objects."""
    want, mine = make_tree(root), make_tree(r)
    checks = 0
    for i, (t, ref) in enumerate(zip(got["tensors"], want["tensors"], strict=True)):
        _equal(t, ref, f"tensor {i}")
        assert t is original["tensors"][i], "tensors are updated in place"
        checks += 1
    for i, (a, ref) in enumerate(zip(got["arrays"], want["arrays"], strict=True)):
        _equal(a, ref, f"array {i}")
        checks += 1
    arrays = original["arrays"]
    assert got["arrays"][0] is arrays[0] and got["arrays"][3] is arrays[3], "arrays are updated in place"
    assert got["arrays"][4].base is arrays[3], "a strided view is written through to its base"
    _equal(arrays[5], mine["arrays"][5], "a read-only array is left alone")
    assert (got["arrays"][5] is arrays[5]) == (r == root), "a read-only array gets a new one"
    for key, value in want["scalars"].items():
        _equal(got["scalars"][key], value, f"scalar {key}")
        checks += 1
    assert got["scalars"] is original["scalars"], "dicts are updated in place"
    _equal(got["pair"].first, want["pair"].first, "namedtuple field")
    assert type(got["pair"]) is Pair and got["pair"].second[0] == root and got["pair"].second[1][0] == root
    assert got["pair"].second[1][1] == "text"
    config = got["config"]
    assert config is original["config"], "a dataclass is updated in place"
    assert (config.lr, config.steps, config.name) == (float(root), root, f"rank-{r}"), config
    _equal(config.weights, want["config"].weights, "dataclass tensor field")
    assert got["frozen"] == want["frozen"] and original["frozen"] == mine["frozen"], "frozen: a new one"
    skipped = got["skipped"]
    assert skipped["name"] == f"rank-{r}" and skipped["nothing"] is None and skipped["fn"] is print
    assert skipped["strings"].tolist() == ["a"]
    return checks + 8


def synchronize_everything() -> dict[str, int]:
    """Every kind of object, from root 0 and from the last rank; fusion; mismatches."""
    import torch

    r, n = phalanx.rank(), phalanx.size()
    checks = 0
    for root in sorted({0, n - 1}):
        training = make_training(r)
        got = phalanx.synchronize(training, root=root)
        assert got is training, "a tuple of mutable objects comes back as the same tuple"
        checks += _check_training(got, make_training(root))
        one = make_training(r)  # each object on its own, too
        assert phalanx.synchronize(one[0], root=root) is one[0]
        assert phalanx.synchronize(one[1], root=root) is one[1]
        assert phalanx.synchronize(one[2], root=root) is one[2]
        state = make_training(r)[0].state_dict()
        phalanx.synchronize(state, root=root)
        for key, value in make_training(root)[0].state_dict().items():
            _equal(state[key], value, f"state dict {key}")
        tree = make_tree(r)
        original = dict(tree)
        original["arrays"] = tuple(tree["arrays"])
        checks += _check_tree(phalanx.synchronize(tree, root=root), original, root, r)
        assert phalanx.synchronize(r, root=root) == root
        got_f = phalanx.synchronize(np.float32(r), root=root)
        assert got_f == root and type(got_f) is np.float32
        assert phalanx.synchronize((r, "x", None), root=root) == (root, "x", None)
        assert phalanx.synchronize(torch.full((3,), float(r)), root=root).tolist() == [root] * 3
        checks += 4
    checks += _fusion(r, n)
    checks += _unsupported(r)
    if n > 1:
        checks += _mismatches(r, n)
    return {"checks": checks}


class _Counting:
    """Counts the backend's data broadcasts and allreduces while installed."""

    def __init__(self) -> None:
        self.backend = phalanx.backend()
        self.broadcasts: list[tuple[str, int]] = []
        self.allreduces = 0

    def __enter__(self) -> _Counting:
        b, real_broadcast, real_allreduce = self.backend, self.backend.broadcast, self.backend.allreduce

        def broadcast(x: Any, root: int, inplace: bool, timeout: float) -> Any:
            self.broadcasts.append((str(x.dtype), int(x.shape[0])))
            return real_broadcast(x, root, inplace, timeout)

        def allreduce(x: Any, op: str, inplace: bool, timeout: float) -> Any:
            self.allreduces += 1
            return real_allreduce(x, op, inplace, timeout)

        b.broadcast, b.allreduce = broadcast, allreduce
        return self

    def __exit__(self, *exc: object) -> None:
        del self.backend.broadcast, self.backend.allreduce


def _fusion(r: int, n: int) -> int:
    import torch

    import phalanx._sync as sync

    torch.manual_seed(r)
    model = torch.nn.Sequential(*(torch.nn.Linear(4, 4) for _ in range(5)))  # 10 float32 tensors
    model.register_buffer("count", torch.tensor(r, dtype=torch.int64))
    model.register_buffer("seen", torch.full((3,), r, dtype=torch.int64))
    with _Counting() as counted:
        phalanx.synchronize(model)
    expected = 1 if n > 1 else 0  # one fused buffer for every dtype on the host
    assert len(counted.broadcasts) == expected, counted.broadcasts
    assert counted.allreduces == (1 if n > 1 else 0), "one structure check"
    assert model.count.item() == 0 and model.seen.tolist() == [0, 0, 0]
    torch.manual_seed(0)
    reference = torch.nn.Sequential(*(torch.nn.Linear(4, 4) for _ in range(5)))
    for p, q in zip(model.parameters(), reference.parameters(), strict=True):
        assert torch.equal(p, q)
    # Everything at once is still one broadcast; small buckets split it, with the same result.
    with _Counting() as counted:
        phalanx.synchronize({"training": make_training(r), "tree": make_tree(r)})
    assert len(counted.broadcasts) == expected, counted.broadcasts
    # A leaf of DIRECT_BYTES or more is broadcast on its own, straight into its memory.
    big = {"weight": torch.full((512, 512), float(r)), "bias": torch.full((512,), float(r)), "step": r}
    with _Counting() as counted:
        phalanx.synchronize(big)
    assert counted.broadcasts == ([("uint8", 2064), ("torch.uint8", 1 << 20)] if n > 1 else []), counted.broadcasts
    assert big["weight"].unique().tolist() == [0.0] and big["bias"].unique().tolist() == [0.0]
    saved = sync.BUCKET_BYTES, sync.DIRECT_BYTES
    sync.BUCKET_BYTES = 64  # small buckets split the fused buffers, with the same result
    try:
        training = make_training(r)
        with _Counting() as counted:
            phalanx.synchronize(training, root=n - 1)
        _check_training(training, make_training(n - 1))
        assert n == 1 or len(counted.broadcasts) > 5, counted.broadcasts
        sync.DIRECT_BYTES = 16  # most leaves direct: contiguous ones in place, the others through copies
        tree = make_tree(r)
        original = dict(tree)
        original["arrays"] = tuple(tree["arrays"])
        _check_tree(phalanx.synchronize(tree, root=n - 1), original, n - 1, r)
        # Contiguous on rank 0 only (60 bytes, not a multiple of the alignment): the sizes still match.
        odd = torch.full((3, 5), float(r)) if r == 0 else torch.full((5, 3), float(r)).t()
        phalanx.synchronize({"odd": odd}, root=n - 1)
        assert odd.unique().tolist() == [float(n - 1)]
    finally:
        sync.BUCKET_BYTES, sync.DIRECT_BYTES = saved
    return 8


def _unsupported(r: int) -> int:
    import torch

    sparse = torch.eye(3).to_sparse()
    try:
        phalanx.synchronize({"ok": torch.ones(2), "sparse": sparse})
    except phalanx.UnsupportedArgumentError as exc:
        assert "obj['sparse']" in str(exc) and "to_dense" in str(exc), str(exc)
    else:
        raise AssertionError("a sparse tensor must be refused")
    try:
        phalanx.synchronize(1, root=phalanx.size())
    except ValueError as exc:
        assert "root=" in str(exc)
    else:
        raise AssertionError("a bad root must be refused")
    return 2


def _expect_mismatch(obj: Any, *needles: str, root: int = 0) -> str:
    try:
        phalanx.synchronize(obj, root=root)
    except phalanx.CollectiveMismatchError as exc:
        text = str(exc)
        for needle in needles:
            assert needle in text, f"{needle!r} not in:\n{text}"
        return text
    raise AssertionError(f"no CollectiveMismatchError for {needles}")


def _mismatches(r: int, n: int) -> int:
    import torch

    last = n - 1
    # A key only some ranks have.
    tree = {"a": torch.full((2,), float(r)), "b": 1.0} if r != last else {"a": torch.full((2,), float(r))}
    _expect_mismatch(tree, "differ at obj['b']", f"rank {last}: nothing (no such entry)",
                     "rank 0: a Python float")
    assert tree["a"].tolist() == [r, r], "nothing was sent"
    assert phalanx.allreduce(1) == n, "the world is still usable"
    # A different shape, then a different dtype.
    shape = (3,) if r == 1 else (2,)
    _expect_mismatch({"w": torch.zeros(shape)}, "obj['w']", "rank 0: a float32[2] torch tensor",
                     "rank 1: a float32[3] torch tensor", "same shape")
    dtype = np.float64 if r == last else np.float32
    _expect_mismatch([np.zeros(4, dtype)], "obj[0]", f"rank {last}: a float64[4] NumPy array", "same dtype")
    # A different kind of scalar.
    _expect_mismatch({"lr": 1 if r == 0 else 1.0}, "obj['lr']", "rank 0: a Python int", "rank 1: a Python float")
    # An optimizer stepped on some ranks only.
    model, adam, _, sgd = make_training(0)
    fresh = torch.optim.Adam(model.parameters()) if r == 0 else adam
    _expect_mismatch(fresh, "obj.state[0]", "rank 0: nothing", "first step")
    # Something that cannot be sent on one rank only is a mismatch too (never a hang).
    _expect_mismatch({"s": torch.eye(2).to_sparse() if r == 0 else torch.eye(2)}, "obj['s']",
                     "rank 0: a torch.sparse_coo tensor", "(cannot be sent)", "rank 1: a float32[2, 2]")
    # Different roots.
    _expect_mismatch(1.0, "different roots", "rank 0: root=0", f"rank {last}: root={last}", root=0 if r == 0 else last)
    # The world is still usable, and a matching call goes through.
    assert phalanx.synchronize({"a": float(r), "b": [r]}, root=last) == {"a": float(last), "b": [last]}
    assert phalanx.allreduce(np.ones(2)).tolist() == [n, n]
    return 9


# -- data ------------------------------------------------------------------------------------------

def data_world() -> dict[str, Any]:
    """The container and sampler with the world's rank/size, gathered to check the whole split."""
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    import phalanx.torch as pt

    r, n = phalanx.rank(), phalanx.size()
    data = list(range(10))
    for remainder in ("pad", "drop", "exact"):
        part = phalanx.DistributedDataContainer(data, remainder=remainder)
        assert (part.rank, part.size) == (r, n)
        counts = phalanx.allgather(np.array([len(part)]))[:, 0].tolist()
        total = phalanx.allreduce(float(sum(part)))
        if remainder == "exact":
            assert sum(counts) == 10 and max(counts) - min(counts) <= 1 and total == 45.0, (counts, total)
        else:
            assert len(set(counts)) == 1, f"{remainder}: every rank the same length, got {counts}"
    # The sampler's permutation is the same on every rank, and the parts tile it.
    dataset = TensorDataset(torch.arange(11) * 10)
    sampler = pt.DistributedSampler(dataset, seed=3)
    orders = []
    for epoch in (0, 1):
        sampler.set_epoch(epoch)
        mine = np.array(list(sampler))
        everyone = phalanx.allgather(mine)  # pad: every rank the same length
        orders.append(everyone.reshape(-1).tolist())
        g = torch.Generator().manual_seed(3 + epoch)
        perm = torch.randperm(11, generator=g).tolist()
        assert orders[-1] == [perm[i % 11] for i in range(len(orders[-1]))], orders[-1]
    assert orders[0] != orders[1], "a new order each epoch"
    # A DataLoader with worker processes (forkserver under MPI) reads exactly the sampler's indices.
    context = pt.dataloader_context(2)
    backend = phalanx.backend().name
    if backend == "mpi":
        assert context is not None and context.get_start_method() in ("forkserver", "spawn"), context
    else:
        assert context is None
    assert pt.dataloader_context(0) is None
    sampler.set_epoch(5)
    loader = DataLoader(dataset, batch_size=2, sampler=sampler, num_workers=2, multiprocessing_context=context)
    seen = [int(v) for (batch,) in loader for v in batch]
    sampler.set_epoch(5)
    assert seen == [10 * i for i in sampler.epoch_indices()], (seen, sampler.epoch_indices())
    return {"rank": r, "context": None if context is None else context.get_start_method(), "seen": len(seen)}


def synchronize_cuda() -> dict[str, Any]:
    """A model on this rank's GPU plus CPU tensors and scalars: one host and one GPU buffer."""
    import torch

    r, n = phalanx.rank(), phalanx.size()
    dev = phalanx.device()
    assert dev.type == "cuda", dev

    def build(seed: int) -> tuple[Any, dict[str, Any]]:
        torch.manual_seed(seed)
        model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4))
        model[1].num_batches_tracked.fill_(seed)
        extra = {"cpu": torch.full((2,), float(seed)), "lr": 0.1 * seed,
                 "half": torch.full((3, 2), seed, dtype=torch.float16).t()}
        return model, extra

    model, extra = build(r)
    model.to(dev)
    extra["half"] = extra["half"].to(dev)
    with _Counting() as counted:
        out = phalanx.synchronize({"model": model, "extra": extra}, root=n - 1)
    assert len(counted.broadcasts) == (2 if n > 1 else 0), counted.broadcasts
    ref_model, ref_extra = build(n - 1)
    for (name, t), (_, ref) in zip(model.state_dict().items(), ref_model.state_dict().items(), strict=True):
        assert t.device.type == "cuda" and torch.equal(t.cpu(), ref), name
    assert torch.equal(extra["cpu"], ref_extra["cpu"]) and out["extra"]["lr"] == ref_extra["lr"]
    assert extra["half"].device.type == "cuda" and torch.equal(extra["half"].cpu(), ref_extra["half"])
    return {"broadcasts": len(counted.broadcasts)}

"""Test bodies for phalanx.synchronize (run on every rank of a world).

Every rank builds its objects (``sync_objects``) from a seed equal to its
rank, so the ranks start out different, and every rank can rebuild root's
objects from root's seed to know what synchronize must leave behind. Each
behaviour is named (``behaviours.Behaviours``) and reported on its own.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import numpy as np

import phalanx
from behaviours import Behaviours
from helpers import raises
from sync_objects import check_training, equal, make_training, make_tree, synchronized_tree

SYNC = Behaviours()
MISMATCHES = Behaviours()  # worlds of more than one rank only
_ROOTS = {"root-0": lambda n: 0, "last-rank": lambda n: n - 1}


def _training_tuple(r: int, n: int, root_of: Any) -> None:
    root = root_of(n)
    training = make_training(r)
    got = phalanx.synchronize(training, root=root)
    assert got is training, "a tuple of mutable objects comes back as the same tuple"
    check_training(got, make_training(root))


def _each_on_its_own(r: int, n: int, root_of: Any) -> None:
    root = root_of(n)
    one = make_training(r)
    for i, what in enumerate(("model", "optimizer", "scheduler")):
        assert phalanx.synchronize(one[i], root=root) is one[i], f"a {what} comes back as itself"


def _state_dict(r: int, n: int, root_of: Any) -> None:
    root = root_of(n)
    state = make_training(r)[0].state_dict()
    phalanx.synchronize(state, root=root)
    for key, value in make_training(root)[0].state_dict().items():
        equal(state[key], value, f"state dict {key}")


def _tree(r: int, n: int, root_of: Any) -> None:
    synchronized_tree(r, root_of(n))


def _plain_values(r: int, n: int, root_of: Any) -> None:
    import torch

    root = root_of(n)
    assert phalanx.synchronize(r, root=root) == root
    got_f = phalanx.synchronize(np.float32(r), root=root)
    assert got_f == root and type(got_f) is np.float32
    assert phalanx.synchronize((r, "x", None), root=root) == (root, "x", None)
    assert phalanx.synchronize(torch.full((3,), float(r)), root=root).tolist() == [root] * 3


for _root, _root_of in _ROOTS.items():
    SYNC.add(f"{_root}-training-tuple-comes-back-as-itself-with-roots-state", _training_tuple, _root_of)
    SYNC.add(f"{_root}-model-optimizer-scheduler-each-on-its-own", _each_on_its_own, _root_of)
    SYNC.add(f"{_root}-state-dict", _state_dict, _root_of)
    SYNC.add(f"{_root}-tree-of-every-kind-of-leaf-and-container", _tree, _root_of)
    SYNC.add(f"{_root}-int-numpy-scalar-tuple-and-tensor", _plain_values, _root_of)


class _Counting:
    """Counts the backend's data broadcasts and allreduces, and the structure agreements, while installed."""

    def __init__(self) -> None:
        self.backend = phalanx.backend()
        self.broadcasts: list[tuple[str, int]] = []
        self.allreduces = 0
        self.agreements = 0  # phalanx._sync's structure agreements (each one small allreduce)

    def __enter__(self) -> _Counting:
        b, real_broadcast, real_allreduce = self.backend, self.backend.broadcast, self.backend.allreduce

        def broadcast(x: Any, root: int, inplace: bool, timeout: float) -> Any:
            self.broadcasts.append((str(x.dtype), int(x.shape[0])))
            return real_broadcast(x, root, inplace, timeout)

        def allreduce(x: Any, op: str, inplace: bool, timeout: float) -> Any:
            self.allreduces += 1
            return real_allreduce(x, op, inplace, timeout)

        import phalanx._sync as sync

        real_agree = self._real_agree = sync.agree

        def agree(world: Any, call: str, value: Any, detail: Any = None) -> Any:
            self.agreements += 1
            return real_agree(world, call, value, detail)

        b.broadcast, b.allreduce, sync.agree = broadcast, allreduce, agree
        return self

    def __exit__(self, *exc: object) -> None:
        import phalanx._sync as sync

        del self.backend.broadcast, self.backend.allreduce
        sync.agree = self._real_agree


@contextlib.contextmanager
def _buckets(bucket_bytes: int, direct_bytes: int | None = None) -> Iterator[None]:
    """Smaller fusion buckets (and direct-leaf threshold) for the duration."""
    import phalanx._sync as sync

    saved = sync.BUCKET_BYTES, sync.DIRECT_BYTES
    sync.BUCKET_BYTES = bucket_bytes
    sync.DIRECT_BYTES = saved[1] if direct_bytes is None else direct_bytes
    try:
        yield
    finally:
        sync.BUCKET_BYTES, sync.DIRECT_BYTES = saved


@SYNC.behaviour("fusion-a-model-is-one-broadcast-and-one-structure-check")
def _(r: int, n: int) -> None:
    import torch

    torch.manual_seed(r)
    model = torch.nn.Sequential(*(torch.nn.Linear(4, 4) for _ in range(5)))  # 10 float32 tensors
    model.register_buffer("count", torch.tensor(r, dtype=torch.int64))
    model.register_buffer("seen", torch.full((3,), r, dtype=torch.int64))
    with _Counting() as counted:
        phalanx.synchronize(model)
    assert len(counted.broadcasts) == (1 if n > 1 else 0), counted.broadcasts  # every dtype on the host
    assert counted.allreduces == 0 and counted.agreements == (1 if n > 1 else 0), "one structure check"
    assert model.count.item() == 0 and model.seen.tolist() == [0, 0, 0]
    torch.manual_seed(0)
    reference = torch.nn.Sequential(*(torch.nn.Linear(4, 4) for _ in range(5)))
    for p, q in zip(model.parameters(), reference.parameters(), strict=True):
        assert torch.equal(p, q)


@SYNC.behaviour("fusion-everything-at-once-is-one-broadcast")
def _(r: int, n: int) -> None:
    with _Counting() as counted:
        phalanx.synchronize({"training": make_training(r), "tree": make_tree(r)})
    assert len(counted.broadcasts) == (1 if n > 1 else 0), counted.broadcasts


@SYNC.behaviour("fusion-a-large-leaf-is-broadcast-on-its-own-into-its-memory")
def _(r: int, n: int) -> None:
    import torch

    big = {"weight": torch.full((512, 512), float(r)), "bias": torch.full((512,), float(r)), "step": r}
    with _Counting() as counted:
        phalanx.synchronize(big)
    assert counted.broadcasts == ([("uint8", 2064), ("torch.uint8", 1 << 20)] if n > 1 else []), counted.broadcasts
    assert big["weight"].unique().tolist() == [0.0] and big["bias"].unique().tolist() == [0.0]


@SYNC.behaviour("fusion-small-buckets-split-it-with-the-same-result")
def _(r: int, n: int) -> None:
    with _buckets(64):
        training = make_training(r)
        with _Counting() as counted:
            phalanx.synchronize(training, root=n - 1)
        check_training(training, make_training(n - 1))
        assert n == 1 or len(counted.broadcasts) > 5, counted.broadcasts


@SYNC.behaviour("fusion-direct-leaves-in-place-or-through-copies-same-result")
def _(r: int, n: int) -> None:
    with _buckets(64, 16):  # most leaves direct: contiguous ones in place, the others through copies
        synchronized_tree(r, n - 1)


@SYNC.behaviour("fusion-a-leaf-contiguous-on-one-rank-only")
def _(r: int, n: int) -> None:
    import torch

    with _buckets(64, 16):  # 60 bytes, not a multiple of the alignment: the sizes still match
        odd = torch.full((3, 5), float(r)) if r == 0 else torch.full((5, 3), float(r)).t()
        phalanx.synchronize({"odd": odd}, root=n - 1)
        assert odd.unique().tolist() == [float(n - 1)]


@SYNC.behaviour("a-sparse-tensor-is-refused-naming-its-path")
def _(r: int, n: int) -> None:
    import torch

    sparse = torch.eye(3).to_sparse()
    with raises(phalanx.UnsupportedArgumentError, "a sparse tensor must be refused") as raised:
        phalanx.synchronize({"ok": torch.ones(2), "sparse": sparse})
    exc = raised.value
    assert "obj['sparse']" in str(exc) and "to_dense" in str(exc), str(exc)


@SYNC.behaviour("a-bad-root-is-refused")
def _(r: int, n: int) -> None:
    with raises(ValueError, "a bad root must be refused") as raised:
        phalanx.synchronize(1, root=phalanx.size())
    exc = raised.value
    assert "root=" in str(exc)


def _expect_mismatch(obj: Any, *needles: str, root: int = 0) -> str:
    with raises(phalanx.CollectiveMismatchError, f"no CollectiveMismatchError for {needles}") as raised:
        phalanx.synchronize(obj, root=root)
    text = str(raised.value)
    for needle in needles:
        assert needle in text, f"{needle!r} not in:\n{text}"
    return text


@MISMATCHES.behaviour("a-key-only-some-ranks-have-sends-nothing")
def _(r: int, n: int) -> None:
    import torch

    last = n - 1
    tree = {"a": torch.full((2,), float(r)), "b": 1.0} if r != last else {"a": torch.full((2,), float(r))}
    _expect_mismatch(tree, "differ at obj['b']", f"rank {last}: nothing (no such entry)",
                     "rank 0: a Python float")
    assert tree["a"].tolist() == [r, r], "nothing was sent"
    assert phalanx.allreduce(1) == n, "the world is still usable"


@MISMATCHES.behaviour("a-different-shape")
def _(r: int, n: int) -> None:
    import torch

    shape = (3,) if r == 1 else (2,)
    _expect_mismatch({"w": torch.zeros(shape)}, "obj['w']", "rank 0: a float32[2] torch tensor",
                     "rank 1: a float32[3] torch tensor", "same shape")


@MISMATCHES.behaviour("a-different-dtype")
def _(r: int, n: int) -> None:
    dtype = np.float64 if r == n - 1 else np.float32
    _expect_mismatch([np.zeros(4, dtype)], "obj[0]", f"rank {n - 1}: a float64[4] NumPy array", "same dtype")


@MISMATCHES.behaviour("a-different-kind-of-scalar")
def _(r: int, n: int) -> None:
    _expect_mismatch({"lr": 1 if r == 0 else 1.0}, "obj['lr']", "rank 0: a Python int", "rank 1: a Python float")


@MISMATCHES.behaviour("an-optimizer-stepped-on-some-ranks-only")
def _(r: int, n: int) -> None:
    import torch

    model, adam, _, sgd = make_training(0)
    fresh = torch.optim.Adam(model.parameters()) if r == 0 else adam
    _expect_mismatch(fresh, "obj.state[0]", "rank 0: nothing", "first step")


@MISMATCHES.behaviour("a-leaf-that-cannot-be-sent-on-one-rank-only")
def _(r: int, n: int) -> None:
    import torch

    _expect_mismatch({"s": torch.eye(2).to_sparse() if r == 0 else torch.eye(2)}, "obj['s']",
                     "rank 0: a torch.sparse_coo tensor", "(cannot be sent)", "rank 1: a float32[2, 2]")


@MISMATCHES.behaviour("different-roots")
def _(r: int, n: int) -> None:
    last = n - 1
    _expect_mismatch(1.0, "different roots", "rank 0: root=0", f"rank {last}: root={last}",
                     root=0 if r == 0 else last)


@MISMATCHES.behaviour("the-world-stays-usable-after-mismatches")
def _(r: int, n: int) -> None:
    last = n - 1
    assert phalanx.synchronize({"a": float(r), "b": [r]}, root=last) == {"a": float(last), "b": [last]}
    assert phalanx.allreduce(np.ones(2)).tolist() == [n, n]


def synchronize_everything() -> dict[str, str | None]:
    """Every kind of object, from root 0 and from the last rank; fusion; refusals; mismatches."""
    r, n = phalanx.rank(), phalanx.size()
    report = SYNC.run(r, n)
    return report | (MISMATCHES.run(r, n) if n > 1 else {})


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

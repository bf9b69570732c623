"""torch.distributed's own libraries on the ``"phalanx"`` backend, against torch's gloo and one process.

Every world makes ``"phalanx"`` torch's default process group
(``phalanx.torch.init_process_group()``) and runs what users run on it: DDP
with ``no_sync``, FSDP2 (``fully_shard`` per block) on a small GPT with AdamW
and ``clip_grad_norm_``, ``ZeroRedundancyOptimizer`` over DDP,
``torch.distributed.nn.functional.all_reduce`` inside autograd, each
operation of the process group, and ``torch.distributed.checkpoint``. In
float64, each result must equal one process on the whole batch to 1e-10. On
a gloo world phalanx's own gloo group stays registered, so the same script
also runs on torch's gloo in the same world (``group=native``) and the two
must agree to 1e-10; the worlds return their results so that the test also
compares an mpi world with the gloo world of its size.
"""

from __future__ import annotations

import os
import time
from typing import Any

import phalanx
from behaviours import Behaviours
from helpers import preload_torch, raises
from worlds_param_shards import gpt, tokens

preload_torch()  # the stall bodies here use torch under 2 s timeouts: no rank may still be importing it

TORCH_DIST = Behaviours()
EXACT = 1e-10
STEPS = 3
RESULTS: dict[str, Any] = {}  # what this rank computed, returned to the test side


def _torch() -> Any:
    import torch
    import torch.distributed as dist

    return torch, dist


def _native() -> Any:
    """torch's own gloo group in a gloo world (phalanx's, still registered), else None."""
    return getattr(phalanx.backend(), "_group", None) if phalanx.backend().name == "gloo" else None


def _flat(torch: Any, tensors: Any) -> list[float]:
    return torch.cat([t.detach().reshape(-1).double() for t in tensors]).tolist()


def _close(a: list[float], b: list[float], what: str) -> None:
    assert len(a) == len(b), f"{what}: {len(a)} values against {len(b)}"
    worst = max((abs(x - y) for x, y in zip(a, b, strict=True)), default=0.0)
    assert worst <= EXACT, f"{what}: differ by {worst:.3g}"


def _both(name: str, run: Any) -> None:
    """``run(group)`` on the "phalanx" default group, and on torch's gloo where the world has it; keep
    the first as this world's result and require the two to agree."""
    mine = run(None)
    RESULTS[name] = mine
    native = _native()
    if native is not None:
        _close(mine, run(native), f"{name}: 'phalanx' against torch's gloo")


# -- DDP with no_sync ------------------------------------------------------------------------
def _mlp(torch: Any) -> Any:
    torch.manual_seed(3)
    nn = torch.nn
    return nn.Sequential(nn.Linear(5, 16), nn.Tanh(), nn.Linear(16, 3)).double()


def _batch(torch: Any, step: int, n: int) -> tuple[Any, Any]:
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(4 * n, 5, generator=g, dtype=torch.float64), torch.randn(4 * n, 3, generator=g,
                                                                                    dtype=torch.float64)


def _ddp_run(group: Any) -> list[float]:
    torch, dist = _torch()
    r, n = dist.get_rank(), dist.get_world_size()
    model = torch.nn.parallel.DistributedDataParallel(_mlp(torch), process_group=group)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for step in range(STEPS):
        x, y = _batch(torch, step, n)
        mine = slice(4 * r, 4 * r + 4)
        halves = (slice(mine.start, mine.start + 2), slice(mine.start + 2, mine.stop))
        with model.no_sync():  # the first micro-batch only accumulates
            torch.nn.functional.mse_loss(model(x[halves[0]]), y[halves[0]]).backward()
        torch.nn.functional.mse_loss(model(x[halves[1]]), y[halves[1]]).backward()
        opt.step()
        opt.zero_grad()
    return _flat(torch, model.parameters())


def _ddp_reference() -> list[float]:
    torch, dist = _torch()
    n = dist.get_world_size()
    model = _mlp(torch)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for step in range(STEPS):
        x, y = _batch(torch, step, n)
        for half in (0, 1):  # each micro-batch: the mean over every rank's half
            rows = torch.cat([torch.arange(4 * k + 2 * half, 4 * k + 2 * half + 2) for k in range(n)])
            torch.nn.functional.mse_loss(model(x[rows]), y[rows]).backward()
        opt.step()
        opt.zero_grad()
    return _flat(torch, model.parameters())


@TORCH_DIST.behaviour("ddp-with-no-sync-equals-one-process-and-gloo")
def _(r: int, n: int, directory: str) -> None:
    _both("ddp", _ddp_run)
    _close(RESULTS["ddp"], _ddp_reference(), "DDP against one process")


# -- FSDP2 on a small GPT -----------------------------------------------------------------
def _fsdp_train(group: Any, steps: int = STEPS) -> Any:
    torch, dist = _torch()
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard

    r, n = dist.get_rank(), dist.get_world_size()
    model, _ = gpt(torch, 11)
    mesh = DeviceMesh.from_group(group or dist.group.WORLD, "cpu")
    for block in model.h:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = _adamw(torch, model)
    for step in range(steps):
        x, y = tokens(torch, step, n)
        mine = slice(2 * r, 2 * r + 2)
        logits = model(x[mine])
        torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), y[mine].reshape(-1)).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        opt.step()
        opt.zero_grad()
    return model, opt


def _adamw(torch: Any, model: Any) -> Any:
    """nanoGPT's decay groups: FSDP2's parameters keep their shapes, so ``p.dim()`` still splits them."""
    params = [p for p in model.parameters() if p.requires_grad]
    return torch.optim.AdamW([{"params": [p for p in params if p.dim() >= 2], "weight_decay": 0.1},
                              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}], lr=0.01)


def _whole(model: Any) -> list[Any]:
    return [p.full_tensor() if hasattr(p, "full_tensor") else p for p in model.state_dict().values()]


def _fsdp_reference() -> list[float]:
    _, dist = _torch()
    return _fsdp_reference_at(dist.get_world_size())


@TORCH_DIST.behaviour("fsdp2-gpt-adamw-clip-equals-one-process-and-gloo")
def _(r: int, n: int, directory: str) -> None:
    torch, _ = _torch()
    _both("fsdp2", lambda group: _flat(torch, _whole(_fsdp_train(group)[0])))
    _close(RESULTS["fsdp2"], _fsdp_reference(), "FSDP2 against one process")


# -- ZeroRedundancyOptimizer over DDP -------------------------------------------------------
def _zero_run(group: Any) -> list[float]:
    torch, dist = _torch()
    from torch.distributed.optim import ZeroRedundancyOptimizer

    r, n = dist.get_rank(), dist.get_world_size()
    model = torch.nn.parallel.DistributedDataParallel(_mlp(torch), process_group=group)
    opt = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.AdamW, lr=0.05,
                                  process_group=group)
    for step in range(STEPS):
        x, y = _batch(torch, step, n)
        mine = slice(4 * r, 4 * r + 4)
        torch.nn.functional.mse_loss(model(x[mine]), y[mine]).backward()
        opt.step()
        opt.zero_grad()
    return _flat(torch, model.parameters())


def _zero_reference() -> list[float]:
    torch, dist = _torch()
    n = dist.get_world_size()
    model = _mlp(torch)
    opt = torch.optim.AdamW(model.parameters(), lr=0.05)
    for step in range(STEPS):
        x, y = _batch(torch, step, n)
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    return _flat(torch, model.parameters())


@TORCH_DIST.behaviour("zero-redundancy-optimizer-over-ddp-equals-one-process-and-gloo")
def _(r: int, n: int, directory: str) -> None:
    _both("zero", _zero_run)
    _close(RESULTS["zero"], _zero_reference(), "ZeroRedundancyOptimizer against one process")


# -- torch.distributed.nn.functional inside autograd ------------------------------------------
def _functional_run(group: Any) -> list[float]:
    torch, dist = _torch()
    from torch.distributed.nn.functional import all_reduce

    r = dist.get_rank()
    x = torch.arange(4, dtype=torch.float64).requires_grad_()
    y = all_reduce(x * (r + 1), group=group or dist.group.WORLD)
    (y * y).sum().backward()
    return [*y.tolist(), *x.grad.tolist()]


@TORCH_DIST.behaviour("nn-functional-all-reduce-differentiates-like-gloo")
def _(r: int, n: int, directory: str) -> None:
    _both("functional", _functional_run)
    total = n * (n + 1) / 2  # sum over ranks of (rank + 1)
    y = [total * i for i in range(4)]
    grad = [(r + 1) * n * 2 * v for v in y]  # backward all-reduces dL/dy = 2y, times d(x (r+1))/dx
    _close(RESULTS["functional"], [*y, *grad], "all_reduce's value and gradient")


# -- every operation of the process group ---------------------------------------------------
def _ops_run(group: Any) -> list[float]:
    torch, dist = _torch()
    r, n = dist.get_rank(), dist.get_world_size()
    out: list[float] = []
    for op in (dist.ReduceOp.SUM, dist.ReduceOp.PRODUCT, dist.ReduceOp.MIN, dist.ReduceOp.MAX):
        t = torch.tensor([r + 1.0, 2.0 - r], dtype=torch.float64)
        dist.all_reduce(t, op, group=group)
        out += t.tolist()
    t = torch.full((3,), float(r))
    dist.broadcast(t, src=n - 1, group=group)
    out += t.tolist()
    t = torch.full((2,), r + 1.0)
    dist.reduce(t, dst=0, group=group)
    out += t.tolist() if r == 0 else [0.0, 0.0]  # elsewhere torch leaves it undefined (gloo: a partial sum)
    parts = [torch.zeros(2) for _ in range(n)]
    dist.all_gather(parts, torch.tensor([r, 10.0 * r]), group=group)
    out += torch.cat(parts).tolist()
    whole = torch.zeros(2 * n)
    dist.all_gather_into_tensor(whole, torch.tensor([r, -1.0 * r]), group=group)
    out += whole.tolist()
    mine = torch.zeros(2)
    dist.reduce_scatter(mine, [torch.full((2,), float(r * n + j)) for j in range(n)], group=group)
    out += mine.tolist()
    dist.reduce_scatter_tensor(mine, torch.arange(2.0 * n) * (r + 1), group=group)
    out += mine.tolist()
    got = [torch.zeros(1) for _ in range(n)]
    dist.all_to_all(got, [torch.tensor([10.0 * r + j]) for j in range(n)], group=group)
    out += torch.cat(got).tolist()
    single = torch.zeros(n)
    dist.all_to_all_single(single, torch.arange(n, dtype=torch.float32) + 10 * r, group=group)
    out += single.tolist()
    # uneven: rank r sends j + 1 rows to rank j, so it receives r + 1 rows from each rank
    send = torch.cat([torch.full((j + 1,), 100.0 * r + j) for j in range(n)])
    recv = torch.zeros((r + 1) * n)
    dist.all_to_all_single(recv, send, output_split_sizes=[r + 1] * n, input_split_sizes=list(range(1, n + 1)),
                           group=group)
    out += recv.tolist()
    gathered = [torch.zeros(2) for _ in range(n)] if r == 0 else None
    dist.gather(torch.tensor([r, r + 0.5]), gathered, dst=0, group=group)
    out += torch.cat(gathered).tolist() if gathered else [0.0] * 2 * n
    piece = torch.zeros(2)
    dist.scatter(piece, [torch.tensor([j, -j * 1.0]) for j in range(n)] if r == n - 1 else None, src=n - 1,
                 group=group)
    out += piece.tolist()
    dist.barrier(group=group)
    objects: list[Any] = [None] * n
    dist.all_gather_object(objects, {"rank": r, "name": "x" * r}, group=group)
    out += [o["rank"] + len(o["name"]) for o in objects]
    some: list[Any] = [None] * n if r == 0 else []
    dist.gather_object((r, "y" * r), some if r == 0 else None, dst=0, group=group)
    out += [a + len(b) for a, b in some] if r == 0 else [0.0] * n
    sent = [{"k": 7.5}, [1, 2]] if r == 0 else [None, None]
    dist.broadcast_object_list(sent, src=0, group=group)
    out += [sent[0]["k"], *sent[1]]
    received: list[Any] = [None]
    dist.scatter_object_list(received, [f"to {j}" * (j + 1) for j in range(n)] if r == 0 else None, src=0,
                             group=group)
    out += [len(received[0])]
    return [float(v) for v in out]


def _p2p_run(group: Any) -> list[float]:
    """The exchanges users write: a ring of isend/irecv waited in either order, send/recv with a tag,
    batch_isend_irecv, and send_object_list/recv_object_list."""
    torch, dist = _torch()
    r, n = dist.get_rank(), dist.get_world_size()
    right, left = (r + 1) % n, (r - 1) % n
    out: list[float] = []
    got = torch.zeros(3, dtype=torch.float64)
    works = [dist.isend(torch.full((3,), r + 0.5, dtype=torch.float64), right, group=group),
             dist.irecv(got, left, group=group)]
    for work in works if r % 2 else reversed(works):
        work.wait()
    out += got.tolist()
    if r == 0:
        dist.send(torch.arange(4.0), n - 1, group=group, tag=7)
    elif r == n - 1:
        box = torch.zeros(4)
        dist.recv(box, 0, group=group, tag=7)
        out += box.tolist()
    ops = [dist.P2POp(dist.isend, torch.tensor([10.0 * r], dtype=torch.float64), right, group=group),
           dist.P2POp(dist.irecv, got[:1], left, group=group)]
    for work in dist.batch_isend_irecv(ops):
        work.wait()
    out += got.tolist()
    objects: list[Any] = [None]
    if r == 0:
        dist.send_object_list([{"from": 0, "text": "abc"}], dst=n - 1, group=group)
    elif r == n - 1:
        dist.recv_object_list(objects, src=0, group=group)
        out += [objects[0]["from"], len(objects[0]["text"])]
    return out


@TORCH_DIST.behaviour("point-to-point-exchanges-equal-gloo")
def _(r: int, n: int, directory: str) -> None:
    if n > 1:
        _both("p2p", _p2p_run)
        assert RESULTS["p2p"][:3] == [(r - 1) % n + 0.5] * 3, RESULTS["p2p"]


def _hsdp_run(group: Any) -> list[float]:
    """FSDP2 on a 2-D mesh (replicate over the ranks, shard over 1: HSDP), and a partition into subgroups
    (torch's new_subgroups_by_enumeration): both reach phalanx as groups of a partition."""
    torch, dist = _torch()
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    r, n = dist.get_rank(), dist.get_world_size()
    parts = [list(range(n - 1)), [n - 1]] if n > 1 else [[0]]
    mine, _ = dist.new_subgroups_by_enumeration(parts)
    t = torch.tensor([r + 1.0], dtype=torch.float64)
    dist.all_reduce(t, group=mine)
    out = [t.item(), float(dist.get_world_size(mine))]
    model = _mlp(torch)
    fully_shard(model, mesh=init_device_mesh("cpu", (n, 1), mesh_dim_names=("replicate", "shard")))
    opt = torch.optim.AdamW(model.parameters(), lr=0.05)
    for step in range(STEPS):
        x, y = _batch(torch, step, n)
        mine_rows = slice(4 * r, 4 * r + 4)
        torch.nn.functional.mse_loss(model(x[mine_rows]), y[mine_rows]).backward()
        opt.step()
        opt.zero_grad()
    return out + _flat(torch, [p.full_tensor() for p in model.parameters()])


@TORCH_DIST.behaviour("subgroups-and-a-2d-mesh-hsdp-equal-one-process")
def _(r: int, n: int, directory: str) -> None:
    RESULTS["hsdp"] = got = _hsdp_run(None)
    members = list(range(n - 1)) if r < n - 1 else [n - 1]
    assert got[:2] == [sum(m + 1.0 for m in members), float(len(members))], got[:2]
    _close(got[2:], _zero_reference(), "HSDP (2-D mesh) against one process")  # AdamW on the whole batch


@TORCH_DIST.behaviour("phalanx-groups-still-work-beside-the-phalanx-backend")
def _(r: int, n: int, directory: str) -> None:
    import numpy as np

    group = phalanx.new_group(list(range(n)))
    assert phalanx.allreduce(np.ones(2), group=group).tolist() == [n, n]
    phalanx.destroy_group(group)


@TORCH_DIST.behaviour("every-operation-equals-gloo")
def _(r: int, n: int, directory: str) -> None:
    _both("ops", _ops_run)


@TORCH_DIST.behaviour("async-op-returns-a-completed-work-and-future")
def _(r: int, n: int, directory: str) -> None:
    torch, dist = _torch()
    t = torch.ones(3)
    work = dist.all_reduce(t, async_op=True)
    assert work.wait() and work.is_completed(), "the work is not complete after wait()"
    value = work.get_future().wait()
    assert torch.equal(value[0], torch.full((3,), float(n))), value
    done = dist.all_gather_into_tensor(torch.zeros(n), torch.ones(1), async_op=True)
    assert done.get_future().wait() is not None and done.is_success()


@TORCH_DIST.behaviour("avg-works-where-gloo-has-none")
def _(r: int, n: int, directory: str) -> None:
    torch, dist = _torch()
    t = torch.tensor([float(r)], dtype=torch.float64)
    dist.all_reduce(t, dist.ReduceOp.AVG)
    assert t.item() == (n - 1) / 2, t


@TORCH_DIST.behaviour("unsupported-op-is-refused-on-every-rank")
def _(r: int, n: int, directory: str) -> None:
    torch, dist = _torch()
    with raises(phalanx.UnsupportedArgumentError, "BXOR on an int tensor was accepted") as caught:
        dist.all_reduce(torch.ones(2, dtype=torch.int64), dist.ReduceOp.BXOR)
    assert "BXOR" in str(caught.value) and "SUM" in str(caught.value), caught.value


@TORCH_DIST.behaviour("mismatched-shape-raises-phalanx-mismatch-on-every-rank-within-5s")
def _(r: int, n: int, directory: str) -> None:
    torch, dist = _torch()
    if n == 1:
        return
    start = time.monotonic()
    with raises(phalanx.CollectiveMismatchError, "a different shape on the last rank was accepted") as caught:
        dist.all_reduce(torch.ones(3 if r == n - 1 else 2))
    assert time.monotonic() - start < 5.0, f"took {time.monotonic() - start:.1f} s"
    assert "[3]" in str(caught.value) and "[2]" in str(caught.value), caught.value


@TORCH_DIST.behaviour("torch-init-process-group-phalanx-after-phalanx-init-makes-phalanx-the-default-group")
def _(r: int, n: int, directory: str) -> None:
    """The body's ``dist.init_process_group("phalanx")`` ran after phalanx.init(): torch's default group is
    the phalanx backend over this world, and phalanx's own collectives still run beside it."""
    torch, dist = _torch()
    assert dist.is_initialized() and dist.get_backend() == "phalanx", dist.get_backend()
    assert dist.group.WORLD.name() == "phalanx" and dist.get_world_size() == n, dist.group.WORLD
    t = torch.full((2,), float(r + 1))
    dist.all_reduce(t)
    assert t.tolist() == [n * (n + 1) / 2] * 2 and phalanx.allreduce(1) == n, t


@TORCH_DIST.behaviour("torch-sees-the-phalanx-backend-and-phalanx-ranks")
def _(r: int, n: int, directory: str) -> None:
    _, dist = _torch()
    assert dist.get_backend() == "phalanx", dist.get_backend()
    assert (dist.get_rank(), dist.get_world_size()) == (r, n)
    import phalanx.torch

    assert phalanx.torch.init_process_group() is dist.group.WORLD  # a second call returns the same group


# -- torch.distributed.checkpoint: saved at 2 ranks, loaded at 3 ------------------------------
@TORCH_DIST.behaviour("dcp-saves-fsdp2-at-2-ranks-and-loads-at-3")
def _(r: int, n: int, directory: str) -> None:
    torch, dist = _torch()
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

    if not directory or n not in (2, 3):
        return
    path = os.path.join(directory, "dcp")
    if n == 2:
        model, _ = _fsdp_train(None)
        dcp.save({"model": get_model_state_dict(model)}, checkpoint_id=path)
        return
    model, _ = _fsdp_train(None, steps=0)  # another sharding of a fresh model, at 3 ranks
    state = {"model": get_model_state_dict(model)}
    dcp.load(state, checkpoint_id=path)
    set_model_state_dict(model, state["model"])
    saved = _fsdp_reference_at(2)
    _close(_flat(torch, _whole(model)), saved, "the model loaded at 3 ranks against the one saved at 2")


def _fsdp_reference_at(n: int) -> list[float]:
    """One process trained as the 2-rank FSDP2 run was (its global batch: 2 ranks' worth)."""
    torch, _ = _torch()
    model, _ = gpt(torch, 11)
    opt = _adamw(torch, model)
    for step in range(STEPS):
        x, y = tokens(torch, step, n)
        logits = model(x)
        torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1)).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        opt.step()
        opt.zero_grad()
    return _flat(torch, model.state_dict().values())


def torch_distributed(directory: str = "") -> dict[str, Any]:
    """The world body: make "phalanx" torch's default group as a torchrun script does, with torch's own
    ``init_process_group("phalanx")`` inside the world phalanx.init() made (on gloo, phalanx's own group
    was torch's default: it is handed over); run every behaviour; the report, and under ``"results"``
    what this rank computed."""
    import torch.distributed as dist

    import phalanx.torch  # noqa: F401  (the behaviours use it)

    dist.init_process_group("phalanx")
    report: dict[str, Any] = dict(TORCH_DIST.run(phalanx.rank(), phalanx.size(), directory))
    report["results"] = RESULTS
    return report


@TORCH_DIST.behaviour("a-received-message-of-another-shape-raises-on-the-receiver")
def _(r: int, n: int, directory: str) -> None:
    torch, dist = _torch()
    if n == 1:  # torch refuses a send to itself before phalanx sees it; phalanx's own check says the same
        from phalanx import _p2p

        with raises(phalanx.InvalidArgumentError, "a send to itself was accepted"):
            _p2p.isend(torch.ones(1), 0)
        return
    if r == 0:
        dist.isend(torch.ones(5), 1, tag=99)  # never completed: the receiver refuses it (the last behaviour)
    elif r == 1:
        with raises(phalanx.CollectiveMismatchError, "5 floats were received into 4") as caught:
            dist.recv(torch.zeros(4), 0, tag=99)
        assert "float32[4]" in str(caught.value) and "float32[5]" in str(caught.value), caught.value


@TORCH_DIST.behaviour("gloo-worlds-keep-torch-gloo-beside-it")
def _(r: int, n: int, directory: str) -> None:
    _, dist = _torch()
    native = _native()
    if phalanx.backend().name != "gloo":
        assert native is None
        return
    assert native is not None and dist.get_backend(native) == "gloo", native  # what _both compares against
    assert dist.group.WORLD is not native


def peer_stops() -> None:
    """The last rank stops dead (SIGSTOP) before an all_reduce on the "phalanx" backend: rank 0 must
    raise phalanx's timeout error naming it, within the collective timeout."""
    import signal

    import phalanx.torch

    torch, dist = _torch()
    phalanx.torch.init_process_group()
    r, n = dist.get_rank(), dist.get_world_size()
    dist.barrier()
    if r == n - 1:
        os.kill(os.getpid(), signal.SIGSTOP)
        time.sleep(60)
    start = time.monotonic()
    with raises(phalanx.CollectiveTimeoutError, "an all_reduce with a stopped peer completed") as caught:
        dist.all_reduce(torch.ones(4))
    raise RuntimeError(f"rank {r}: TIMES raised={time.monotonic() - start:.2f} | {caught.value}")

"""In-process replicas (phalanx.torch.replicate / withdevices): k replicas, alone or on each of N processes,
train exactly like one model on the whole batch.

In this process: k = 1, 2, 3 CPU replicas with SGD (momentum) and Adam, in both usage patterns (one
optimizer over replica 0 + synchronize, or Conflux's one optimizer per replica); no aliasing between
replicas; errors raised in a replica's thread; unused parameters; mismatched replicas; op="sum"; grad
mode and autocast in the threads; scatter; buffers; argument errors. In worlds (local-1, mpi-2/3,
gloo-2/3; one world each, see ``worlds_replicas``): N processes x 2 replicas equal one model on all
N*2 shards, and unequal replica counts or models are the same clear error on every rank. CUDA tests
need GPUs and skip without them. The example script runs as a user would run it.
"""

from __future__ import annotations

import collections
import copy
import os
import subprocess
import sys
import threading
import time
from typing import Any

import pytest

torch = pytest.importorskip("torch")

import phalanx  # noqa: E402
import phalanx.torch as pt  # noqa: E402
import worlds_replicas as bodies  # noqa: E402
from conftest import world_params  # noqa: E402
from helpers import requires_cuda  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0


@pytest.fixture(autouse=True)
def one_thread() -> Any:
    """One intra-op thread per replica thread (and exact float64 results); restored afterwards."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def small(seed: int = 0) -> Any:
    return bodies.mlp(torch, seed)


def fill_grads(replicas: Any, value: Any) -> None:
    for i, m in enumerate(replicas):
        for p in m.parameters():
            p.grad = torch.full_like(p, float(value(i)))


# -- replicate ---------------------------------------------------------------------------------

def test_replica_0_is_the_model_and_the_others_are_independent_copies() -> None:
    model = small()
    params_before = list(model.parameters())
    replicas = pt.replicate(model, ["cpu", "cpu", "cpu"])
    assert replicas[0] is model and list(replicas[0].parameters()) == params_before
    assert len(replicas) == replicas.count == 3 and list(replicas) == [replicas[0], replicas[1], replicas[2]]
    assert replicas.devices == [torch.device("cpu")] * 3 and replicas[1:] == [replicas[1], replicas[2]]
    assert repr(replicas) == "Replicas(3 on cpu, cpu, cpu)"
    assert isinstance(replicas, collections.abc.Sequence)
    storages = [{t.untyped_storage().data_ptr() for t in [*m.parameters(), *m.buffers()]} for m in replicas]
    assert all(storages[i].isdisjoint(storages[j]) for i in range(3) for j in range(i + 1, 3))
    assert replicas.in_sync()
    with torch.no_grad():
        replicas[1][0].weight.add_(1.0)  # a write to one replica reaches no other
    assert torch.equal(replicas[0][0].weight, replicas[2][0].weight)
    assert not torch.equal(replicas[0][0].weight, replicas[1][0].weight) and not replicas.in_sync()


def test_replicas_made_by_hand_must_not_share_tensors() -> None:
    model = small()
    with pytest.raises(phalanx.InvalidArgumentError, match=r"replicas 0 and 1 share parameter 0.weight"):
        pt.Replicas([model, model], ["cpu", "cpu"])
    with pytest.raises(phalanx.InvalidArgumentError, match="one device per module"):
        pt.Replicas([model], ["cpu", "cpu"])
    assert pt.Replicas([model, copy.deepcopy(model)], ["cpu", "cpu"]).in_sync()


def test_an_optimizer_built_before_replicate_keeps_stepping_replica_0() -> None:
    model = small()
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    replicas = pt.replicate(model, 2)
    before = copy.deepcopy(replicas[0].state_dict())
    fill_grads(replicas, lambda i: 1.0)
    opt.step()
    for name, value in replicas[0].state_dict().items():
        assert torch.allclose(value, before[name] - 1.0, rtol=0, atol=1e-12), name
    assert not replicas.in_sync()
    replicas.synchronize()
    assert replicas.in_sync()


@pytest.mark.parametrize("devices,message", [
    (0, "at least 1"),
    (-1, "at least 1"),
    (True, "pass a list of devices"),
    ("cpu", "pass a list of devices"),
    ([], "at least one device"),
    (["cpu", "gpu:0"], "'gpu:0' is not a device"),
    (["cpu", "meta"], "'meta'"),
    ([1.5], "is not a device"),
])
def test_bad_devices_are_argument_errors(devices: Any, message: str) -> None:
    with pytest.raises(phalanx.InvalidArgumentError, match="phalanx.torch.replicate") as error:
        pt.replicate(small(), devices)
    assert message in str(error.value)
    with pytest.raises(phalanx.InvalidArgumentError, match="phalanx.torch.withdevices"):
        pt.withdevices(lambda i, d: i, devices)


@pytest.mark.skipif(GPUS > 0, reason="checks the CPU-only behaviour; this machine has a GPU")
def test_without_gpu_none_and_cuda_devices_say_to_use_cpu_replicas() -> None:
    with pytest.raises(phalanx.InvalidArgumentError, match=r"Pass an int for that many CPU replicas"):
        pt.replicate(small())
    with pytest.raises(phalanx.InvalidArgumentError, match=r"no GPU is visible"):
        pt.replicate(small(), ["cuda:0", "cuda:1"])
    assert pt.replicate(small(), 2).devices == [torch.device("cpu")] * 2  # an int k: k CPU replicas


@requires_cuda()
def test_with_gpus_an_int_takes_the_first_gpus_and_no_more() -> None:
    assert pt.replicate(small(), 1).devices == [torch.device("cuda", 0)]
    with pytest.raises(phalanx.InvalidArgumentError, match="visible"):
        pt.replicate(small(), GPUS + 1)


def test_a_model_that_cannot_be_copied_is_a_clear_error() -> None:
    class Holder(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = torch.nn.Linear(2, 2)
            self.cached = self.lin.weight * 2  # a non-leaf tensor: deepcopy refuses it

    with pytest.raises(phalanx.InvalidArgumentError, match=r"copy.deepcopy\(model\) failed"):
        pt.replicate(Holder(), 2)
    with pytest.raises(phalanx.InvalidArgumentError, match="pass a torch.nn.Module"):
        pt.replicate([small()], 2)


# -- training equals one model on the whole batch ----------------------------------------------

@pytest.mark.parametrize("pattern", ["a", "b"], ids=["one-optimizer+synchronize", "optimizer-per-replica"])
@pytest.mark.parametrize("kind", ["sgd", "adam"])
@pytest.mark.parametrize("k", [1, 2, 3])
def test_k_replicas_train_like_one_model_on_the_whole_batch(k: int, kind: str, pattern: str) -> None:
    bodies.train(k, kind, pattern)  # every tensor of every replica within 1e-10 of the reference


@pytest.mark.parametrize("op", ["avg", "sum"])
def test_the_nccl_branch_reduces_like_the_host_branch(op: str) -> None:
    # NCCL needs several GPUs; this runs its branch with torch.cuda.nccl's semantics on the CPU.
    with bodies.fake_nccl():
        bodies.train(3, "sgd", "a")
        replicas = pt.replicate(small(), 3)
        fill_grads(replicas, lambda i: i + 1)
        replicas.allreduce_gradients(op)
    expect = 6.0 if op == "sum" else 2.0
    assert all(torch.equal(p.grad, torch.full_like(p, expect)) for m in replicas for p in m.parameters())


# -- withdevices -------------------------------------------------------------------------------

def test_withdevices_runs_the_replicas_concurrently_in_order() -> None:
    meeting = threading.Barrier(3, timeout=10)  # passes only if all three calls run at once

    def meet(i: int, device: Any) -> tuple[int, str, str]:
        meeting.wait()
        return i, str(device), threading.current_thread().name

    results = pt.withdevices(meet, 3)
    assert [r[:2] for r in results] == [(0, "cpu"), (1, "cpu"), (2, "cpu")]
    assert len({r[2] for r in results}) == 3
    replicas = pt.replicate(small(), 2)
    assert pt.withdevices(lambda i, d: (i, d), replicas) == [(0, torch.device("cpu")),
                                                             (1, torch.device("cpu"))]
    assert pt.withdevices(lambda i, d: threading.current_thread(), ["cpu"]) == [threading.current_thread()]


def test_an_exception_in_one_replica_surfaces_after_the_others_finish() -> None:
    finished: list[int] = []

    def work(i: int, device: Any) -> int:
        if i == 1:
            raise ValueError("replica 1 failed")
        time.sleep(0.3)
        finished.append(i)
        return i

    with pytest.raises(ValueError, match="replica 1 failed") as error:
        pt.withdevices(work, 3)
    assert sorted(finished) == [0, 2]  # the other threads ran to their end first
    if sys.version_info >= (3, 11):
        assert error.value.__notes__ == ["(in phalanx.torch.withdevices: replica 1, on cpu)"]


def test_of_several_exceptions_the_earliest_is_raised() -> None:
    def work(i: int, device: Any) -> None:
        if i == 0:
            time.sleep(0.3)
            raise KeyError("late")
        if i == 2:
            raise RuntimeError("early")

    with pytest.raises(RuntimeError, match="early") as error:
        pt.withdevices(work, 3)
    if sys.version_info >= (3, 11):
        assert "replica 2" in error.value.__notes__[0]
    with pytest.raises(ZeroDivisionError) as single:  # one replica: called directly, same note
        pt.withdevices(lambda i, d: 1 / 0, 1)
    if sys.version_info >= (3, 11):
        assert "replica 0, on cpu" in single.value.__notes__[0]


def test_grad_mode_inference_mode_and_autocast_are_carried_into_the_threads() -> None:
    def state(i: int, device: Any) -> tuple[bool, bool]:
        return torch.is_grad_enabled(), torch.is_inference_mode_enabled()

    assert pt.withdevices(state, 2) == [(True, False)] * 2
    with torch.no_grad():
        assert pt.withdevices(state, 2) == [(False, False)] * 2
    with torch.inference_mode():
        assert pt.withdevices(state, 2) == [(False, True)] * 2
    lin = torch.nn.Linear(4, 4)
    x = torch.randn(2, 4)

    def cast(i: int, device: Any) -> tuple[bool, Any, Any]:
        return torch.is_autocast_enabled("cpu"), torch.get_autocast_dtype("cpu"), lin(x).dtype

    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert pt.withdevices(cast, 2) == [(True, torch.bfloat16, torch.bfloat16)] * 2
    assert pt.withdevices(cast, 2)[1][::2] == (False, torch.float32)


# -- allreduce_gradients -----------------------------------------------------------------------

class Branchy(torch.nn.Module):
    """``extra`` is used by the replicas given use_extra only; ``never`` by none."""

    def __init__(self) -> None:
        super().__init__()
        nn = torch.nn
        self.body, self.extra, self.never, self.head = nn.Linear(4, 6), nn.Linear(6, 6), nn.Linear(6, 6), \
            nn.Linear(6, 2)

    def forward(self, x: Any, use_extra: bool) -> Any:
        h = torch.tanh(self.body(x))
        return self.head(h + torch.tanh(self.extra(h)) if use_extra else h)


def test_a_parameter_unused_on_some_replicas_reduces_as_zeros_there() -> None:
    torch.manual_seed(3)
    model = Branchy().double()
    ref = copy.deepcopy(model)
    replicas = pt.replicate(model, 3)
    x, y = torch.randn(9, 4, dtype=torch.float64), torch.randn(9, 2, dtype=torch.float64)
    chunks = replicas.scatter((x, y))

    def forward_backward(i: int, device: Any) -> None:
        xi, yi = chunks[i]
        torch.nn.functional.mse_loss(replicas[i](xi, use_extra=i == 1), yi).backward()

    pt.withdevices(forward_backward, replicas)
    assert replicas[0].extra.weight.grad is None and replicas[1].extra.weight.grad is not None
    replicas.allreduce_gradients()
    # The reference: the mean of the three chunk losses, in one model.
    sum(torch.nn.functional.mse_loss(ref(x[3 * i:3 * i + 3], use_extra=i == 1), y[3 * i:3 * i + 3])
        for i in range(3)).div(3).backward()
    for i, m in enumerate(replicas):
        for (name, p), q in zip(m.named_parameters(), ref.parameters(), strict=True):
            if name.startswith("never"):
                assert p.grad is None and q.grad is None, f"replica {i}: {name} must keep grad=None"
            else:
                assert p.grad is not None and torch.allclose(p.grad, q.grad, rtol=0, atol=1e-12), \
                    f"replica {i}: {name}"


def test_op_sum_and_avg() -> None:
    replicas = pt.replicate(small(), 3)
    fill_grads(replicas, lambda i: i + 1)
    replicas.allreduce_gradients("sum")
    assert all(torch.equal(p.grad, torch.full_like(p, 6.0)) for m in replicas for p in m.parameters())
    fill_grads(replicas, lambda i: i + 1)
    replicas.allreduce_gradients()
    assert all(torch.equal(p.grad, torch.full_like(p, 2.0)) for m in replicas for p in m.parameters())
    with pytest.raises(phalanx.InvalidArgumentError, match=r"allreduce_gradients\(op='max'\)"):
        replicas.allreduce_gradients("max")


def test_mixed_dtypes_and_frozen_parameters() -> None:
    nn = torch.nn
    model = nn.Sequential(nn.Linear(3, 3).double(), nn.Linear(3, 3), nn.Linear(3, 3).double())
    model[2].requires_grad_(False)
    replicas = pt.replicate(model, 2)
    fill_grads(replicas, lambda i: 2 * i)
    replicas.allreduce_gradients()
    for m in replicas:
        for p in [*m[0].parameters(), *m[1].parameters()]:
            assert torch.equal(p.grad, torch.ones_like(p)), p.dtype
        assert all(torch.equal(p.grad, torch.full_like(p, 2.0 * (m is replicas[1])))
                   for p in m[2].parameters())  # frozen: not reduced


def test_replicas_that_no_longer_match_are_a_clear_error() -> None:
    replicas = pt.replicate(small(), 3)
    replicas[2][2] = torch.nn.Linear(12, 7).double()  # a different layer on replica 2
    fill_grads(replicas, lambda i: i)
    with pytest.raises(phalanx.CollectiveMismatchError) as error:
        replicas.allreduce_gradients()
    message = str(error.value)
    assert "replica 2 no longer has the same trainable parameters as replica 0" in message
    assert "#2:\n  replica 0: 2.weight: float64[12, 12]\n  replica 2: 2.weight: float64[7, 12]\n" in message
    assert all(torch.equal(p.grad, torch.full_like(p, float(i)))
               for i, m in enumerate(replicas) for p in m.parameters()), "nothing may change"
    with pytest.raises(phalanx.CollectiveMismatchError, match="replica 2 no longer"):
        replicas.synchronize()

    fewer = pt.replicate(small(), 2)
    fewer[1][4].bias.requires_grad_(False)  # frozen on one replica only: one parameter fewer
    with pytest.raises(phalanx.CollectiveMismatchError,
                       match=r"\(5 against 6\)[\s\S]*#5:[\s\S]*none \(it has only 5\)"):
        fewer.allreduce_gradients()


def test_sparse_gradients_are_refused() -> None:
    replicas = pt.replicate(torch.nn.Embedding(5, 2, sparse=True), 2)

    def backward(i: int, device: Any) -> None:
        replicas[i](torch.tensor([i])).sum().backward()

    pt.withdevices(backward, replicas)
    with pytest.raises(phalanx.InvalidArgumentError, match="sparse gradient"):
        replicas.allreduce_gradients()


# -- synchronize, in_sync, zero_grad -----------------------------------------------------------

def test_synchronize_copies_parameters_and_buffers_of_replica_0() -> None:
    nn = torch.nn
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4)).double()
    replicas = pt.replicate(model, 2)
    chunks = replicas.scatter(torch.randn(8, 4, dtype=torch.float64))
    pt.withdevices(lambda i, d: replicas[i](chunks[i]), replicas)  # different running statistics
    with torch.no_grad():
        replicas[1][0].weight.mul_(2)
    assert not replicas.in_sync()
    replicas.synchronize(buffers=False)
    first, second = replicas
    assert all(torch.equal(p, q) for p, q in zip(first.parameters(), second.parameters(), strict=True))
    assert not torch.equal(first[1].running_mean, second[1].running_mean) and not replicas.in_sync()
    replicas.synchronize()
    assert replicas.in_sync()
    assert replicas[1][1].num_batches_tracked.item() == 1  # integer buffers too


def test_in_sync_tolerance_and_zero_grad() -> None:
    replicas = pt.replicate(small(), 2)
    with torch.no_grad():
        replicas[1][0].bias.add_(1e-12)
    assert not replicas.in_sync() and replicas.in_sync(atol=1e-9)
    fill_grads(replicas, lambda i: 1)
    replicas.zero_grad(set_to_none=False)
    assert all(p.grad is not None and not p.grad.any() for m in replicas for p in m.parameters())
    replicas.zero_grad()
    assert all(p.grad is None for m in replicas for p in m.parameters())


# -- scatter -----------------------------------------------------------------------------------

def test_scatter_splits_nested_batches_into_equal_chunks() -> None:
    Pair = collections.namedtuple("Pair", "x y")
    replicas = pt.replicate(small(), 3)
    x, y, z = torch.arange(6.0), torch.arange(12.0).view(6, 2), torch.arange(3.0)
    chunks = replicas.scatter({"pair": Pair(x, y), "list": [z, "tag"], "none": None})
    assert len(chunks) == 3
    for i, chunk in enumerate(chunks):
        assert isinstance(chunk["pair"], Pair) and isinstance(chunk["list"], list)
        assert chunk["pair"].x.tolist() == [2.0 * i, 2.0 * i + 1] and chunk["pair"].y.shape == (2, 2)
        assert chunk["list"][0].tolist() == [float(i)] and chunk["list"][1] == "tag" and chunk["none"] is None
        assert chunk["pair"].x.device == replicas.devices[i]
    assert [c.tolist() for c in replicas.scatter(x)] == [[0.0, 1.0], [2.0, 3.0], [4.0, 5.0]]


@pytest.mark.parametrize("batch,message", [
    (torch.zeros(7, 2), r"batch has 7 samples along dim 0, which do not split into 3"),
    ((torch.zeros(6), torch.zeros(4)), r"batch\[1\] has 4 samples"),
    ({"x": torch.zeros(0)}, r"batch\['x'\] has 0 samples"),
    (torch.tensor(1.0), "0-dimensional"),
    ([torch.zeros(3).numpy()], r"batch\[0\] is a NumPy array"),
])
def test_scatter_refuses_batches_that_do_not_split_equally(batch: Any, message: str) -> None:
    with pytest.raises(phalanx.InvalidArgumentError, match=message):
        pt.replicate(small(), 3).scatter(batch)


# -- processes x replicas ----------------------------------------------------------------------

REPLICA_WORLDS = [("local", 1), ("mpi", 2), ("mpi", 3), ("gloo", 2), ("gloo", 3)]
REPLICA_WORLD = {"timeout": 120, "op_timeout": 30}


@pytest.mark.parametrize("behaviour", bodies.REPLICAS.names)
@pytest.mark.parametrize("backend,n", world_params(REPLICA_WORLDS))
def test_processes_times_replicas(worlds, backend: str, n: int, behaviour: str) -> None:
    worlds.check(bodies.processes_and_replicas, backend, n, behaviour, **REPLICA_WORLD)


@pytest.mark.parametrize("behaviour", bodies.ACROSS_RANKS.names)
@pytest.mark.parametrize("backend,n", world_params([w for w in REPLICA_WORLDS if w[1] > 1]))
def test_processes_times_replicas_across_ranks(worlds, backend: str, n: int, behaviour: str) -> None:
    worlds.check(bodies.processes_and_replicas, backend, n, behaviour, **REPLICA_WORLD)  # the same world


# -- CUDA --------------------------------------------------------------------------------------

@requires_cuda(2)
@pytest.mark.parametrize("pattern", ["a", "b"])
def test_replicas_on_two_gpus_match_the_cpu_reference(pattern: str) -> None:
    # distinct GPUs: the gradients are reduced with NCCL within the process
    bodies.train(2, "adam", pattern, devices=["cuda:0", "cuda:1"], tol=1e-8)


@requires_cuda()
@pytest.mark.parametrize("devices", [["cuda:0", "cuda:0"], ["cpu", "cuda:0"], ["cuda:0", "cpu"]])
def test_replicas_on_one_gpu_and_mixed_devices_match_the_cpu_reference(devices: list[str]) -> None:
    bodies.train(2, "sgd", "a", devices=devices, tol=1e-8)


# -- the example -------------------------------------------------------------------------------

def test_the_example_script_trains_on_digits() -> None:
    pytest.importorskip("sklearn")
    result = subprocess.run([sys.executable, os.path.join(ROOT, "examples", "replicas.py"), "--epochs", "2"],
                            capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert result.returncode == 0, result.stdout + result.stderr
    lines = result.stdout.splitlines()
    losses = [float(line.split("loss ")[1]) for line in lines if line.startswith("epoch ")]
    assert len(losses) == 2 and losses[1] < losses[0], result.stdout
    accuracy = float(lines[-1].split("test accuracy ")[1].split()[0])
    assert accuracy > 0.5 and "Replicas(2 on cpu, cpu)" in lines[-1], result.stdout

"""ResNets: torchvision's parameter counts, names, shapes and initialisation; SyncBatchNorm conversion;
resnet_tiny learning the tiny ImageNet in one process and in a 2-rank world (DataLoader workers started
as phalanx.torch.dataloader_context says: forkserver under MPI)."""

from __future__ import annotations

import copy
import math
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader

from conftest import AVAILABLE, world_params
from phalanx import InvalidArgumentError
from phalanx.testing import run_world
from phalanx.train import ImageNet, eval_transform, make_tiny_imagenet, models, train_transform

TORCHVISION_COUNTS = {  # sum(p.numel() for p in torchvision.models.resnetXX().parameters())
    "resnet18": 11_689_512,
    "resnet34": 21_797_672,
    "resnet50": 25_557_032,
    "resnet101": 44_549_160,
    "resnet152": 60_192_808,
}


def count(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


@pytest.fixture(scope="module")
def tree(tmp_path_factory: pytest.TempPathFactory) -> str:
    return make_tiny_imagenet(tmp_path_factory.mktemp("models") / "tiny", classes=4, train_per_class=16,
                              val_per_class=8, size=48, seed=0)


def test_parameter_counts_match_torchvision() -> None:
    with torch.device("meta"):  # shapes only: no memory, no initialisation
        for name, expected in TORCHVISION_COUNTS.items():
            build = getattr(models, name)
            assert count(build()) == expected, name
        for build, features in ((models.resnet18, 512), (models.resnet50, 2048)):
            assert count(build(num_classes=10)) == TORCHVISION_COUNTS[build.__name__] - (features + 1) * 990


def test_layer_names_and_shapes_are_torchvision_s() -> None:
    with torch.device("meta"):
        r18 = models.resnet18().state_dict()
        r50 = models.resnet50()
    shapes = {"conv1.weight": (64, 3, 7, 7), "bn1.running_var": (64,), "layer1.0.conv1.weight": (64, 64, 3, 3),
              "layer2.0.downsample.0.weight": (128, 64, 1, 1), "layer2.0.downsample.1.running_mean": (128,),
              "layer4.1.bn2.weight": (512,), "fc.weight": (1000, 512), "fc.bias": (1000,)}
    assert {k: tuple(r18[k].shape) for k in shapes} == shapes
    assert len(r18) == 122 and "layer1.0.downsample.0.weight" not in r18
    state = r50.state_dict()
    assert tuple(state["layer1.0.conv3.weight"].shape) == (256, 64, 1, 1)
    assert tuple(state["layer1.0.downsample.0.weight"].shape) == (256, 64, 1, 1)
    assert tuple(state["fc.weight"].shape) == (1000, 2048) and len(state) == 320
    # v1.5: a downsampling bottleneck strides on its 3x3 convolution
    assert r50.layer2[0].conv1.stride == (1, 1) and r50.layer2[0].conv2.stride == (2, 2)
    assert r50.layer2[0].downsample[0].stride == (2, 2)


def test_forward_shapes() -> None:
    torch.manual_seed(0)
    with torch.no_grad():
        assert models.resnet18().eval()(torch.randn(2, 3, 64, 64)).shape == (2, 1000)
        assert models.resnet50(num_classes=5).eval()(torch.randn(1, 3, 32, 32)).shape == (1, 5)
        small = models.resnet_tiny(num_classes=3, width=8, in_channels=1)
        assert small(torch.randn(4, 1, 40, 32)).shape == (4, 3)
        assert small.features(torch.randn(4, 1, 40, 32)).shape == (4, 64)
        assert small.conv1.weight.shape == (8, 1, 7, 7)
    tiny = models.resnet_tiny()
    assert count(tiny) == 310_746 and tiny.fc.out_features == 10
    assert [len(getattr(tiny, f"layer{i}")) for i in range(1, 5)] == [1, 1, 1, 1]


def test_initialisation_is_torchvision_s() -> None:
    torch.manual_seed(0)
    model = models.resnet18()
    for name, module in model.named_modules():
        if isinstance(module, nn.Conv2d):
            out, _, kh, kw = module.weight.shape
            expected = math.sqrt(2.0 / (out * kh * kw))  # Kaiming normal, fan_out, ReLU
            assert abs(module.weight.std().item() / expected - 1) < 0.1, name
        elif isinstance(module, nn.BatchNorm2d):
            assert torch.all(module.weight == 1) and torch.all(module.bias == 0), name
    bound = 1 / math.sqrt(512)  # nn.Linear's default
    assert model.fc.weight.abs().max() <= bound and model.fc.weight.abs().max() > 0.9 * bound

    for build, last in ((models.resnet18, "bn2"), (models.resnet50, "bn3")):
        zero = build(zero_init_residual=True).eval()
        blocks = [m for m in zero.modules() if isinstance(m, (models.BasicBlock, models.Bottleneck))]
        assert blocks and all(torch.all(getattr(b, last).weight == 0) for b in blocks)
        assert all(torch.all(b.bn1.weight == 1) for b in blocks)
        x = torch.relu(torch.randn(2, zero.layer1[1].conv1.in_channels, 8, 8))
        with torch.no_grad():
            assert torch.equal(zero.layer1[1](x), x)  # each residual block starts as the identity


def test_bad_arguments_are_refused() -> None:
    for make, match in [(lambda: models.ResNet(models.BasicBlock, [2, 2, 2]), "layers must be 4"),
                        (lambda: models.ResNet(models.BasicBlock, [2, 0, 2, 2]), "every entry of layers"),
                        (lambda: models.resnet18(num_classes=0), "num_classes"),
                        (lambda: models.resnet_tiny(width=0), "width"),
                        (lambda: models.ResNet(nn.Linear, [1, 1, 1, 1]), "block must be")]:
        with pytest.raises(InvalidArgumentError, match=match):
            make()


def test_convert_sync_batchnorm_keeps_the_model() -> None:
    import phalanx.torch as pt

    torch.manual_seed(0)
    model = models.resnet_tiny(num_classes=4).eval()
    converted = pt.convert_sync_batchnorm(copy.deepcopy(model)).eval()
    batchnorms = [m for m in model.modules() if isinstance(m, nn.BatchNorm2d)]
    syncs = [m for m in converted.modules() if isinstance(m, pt.SyncBatchNorm)]
    assert len(batchnorms) == len(syncs) == 12
    assert not any(isinstance(m, nn.BatchNorm2d) for m in converted.modules())
    assert list(converted.state_dict()) == list(model.state_dict())
    x = torch.randn(3, 3, 48, 48)
    with torch.no_grad():
        assert torch.allclose(converted(x), model(x), atol=1e-6)


def train(model: nn.Module, loader: DataLoader, epochs: int) -> list[float]:
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, weight_decay=5e-4)
    losses = []
    model.train()
    for _ in range(epochs):
        for x, y in loader:
            loss = nn.functional.cross_entropy(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.item())
    return losses


def accuracy(model: nn.Module, data: ImageNet) -> float:
    model.eval()
    right = 0
    with torch.no_grad():
        for x, y in DataLoader(data, batch_size=32):
            right += (model(x).argmax(1) == y).sum().item()
    return right / len(data)


def test_resnet_tiny_learns_the_tiny_imagenet(tree: str) -> None:
    torch.manual_seed(0)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        train_set = ImageNet(tree, "train", train_transform(40, scale=(0.3, 1)))
        val_set = ImageNet(tree, "val", eval_transform(40, resize=48))
        model = models.resnet_tiny(num_classes=4)
        before = accuracy(model, val_set)
        losses = train(model, DataLoader(train_set, batch_size=16, shuffle=True), epochs=6)
        after = accuracy(model, val_set)
    finally:
        torch.set_num_threads(threads)
    first, last = sum(losses[:4]) / 4, sum(losses[-4:]) / 4
    assert last < 0.6 * first, losses
    assert after >= 0.5 and after > before, (before, after)  # chance is 0.25


def ranks_train_on_the_tiny_imagenet(root: str) -> dict[str, Any]:
    """A 2-rank world: DataLoader workers as dataloader_context says, SyncBatchNorm, DataParallel."""
    import phalanx
    import phalanx.torch as pt

    torch.set_num_threads(1)
    torch.manual_seed(phalanx.rank())  # different initial weights: DataParallel broadcasts rank 0's
    data = ImageNet(root, "train", train_transform(32, scale=(0.3, 1)))
    context = pt.dataloader_context(2)
    method = context.get_start_method() if context is not None else None
    if method == "forkserver":
        context.set_forkserver_preload(["torch", "phalanx.train._images"])  # workers start in ~1 s, not ~5 s
    sampler = pt.DistributedSampler(data, seed=0)
    loader = DataLoader(data, batch_size=8, sampler=sampler, num_workers=2, multiprocessing_context=context)
    model = pt.DataParallel(pt.convert_sync_batchnorm(models.resnet_tiny(num_classes=4, width=8)))
    losses = train(model, loader, epochs=1)
    flat = torch.cat([t.detach().double().flatten() for t in model.module.state_dict().values()])
    spread = phalanx.allreduce(flat, op="max") - phalanx.allreduce(flat.clone(), op="min")
    return {"method": method, "losses": losses, "spread": spread.abs().max().item(),
            "labels": sorted(data.targets[i] for i in sampler)}


@pytest.mark.parametrize("backend,n", world_params([("mpi", 2) if "mpi" in AVAILABLE else ("gloo", 2)]))
def test_ranks_train_resnet_tiny_with_workers_and_syncbn(tree: str, backend: str, n: int) -> None:
    results = run_world(ranks_train_on_the_tiny_imagenet, n, backend, args=(tree,), timeout=240, op_timeout=120)
    assert [r["method"] for r in results] == (["forkserver"] * n if backend == "mpi" else [None] * n)
    for r in results:
        assert r["spread"] == 0.0  # replicas identical after training
        assert len(r["losses"]) == 4 and all(math.isfinite(v) for v in r["losses"])
    assert sorted(sum((r["labels"] for r in results), [])) == sorted(ImageNet(tree, "train").targets)


def test_example_names_exist() -> None:
    # what examples/imagenet_resnet.py uses
    import phalanx.train as train_pkg

    for name in ("resnet18", "resnet34", "resnet50", "resnet_tiny", "ResNet", "BasicBlock", "Bottleneck"):
        assert hasattr(models, name)
    assert train_pkg.models is models
    assert Path(models.__file__).name == "models.py"

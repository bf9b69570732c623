"""Train a ResNet on ImageNet with phalanx.train.fit: over processes, in-process replicas, or both.

::

    phalanx run -n 2 examples/imagenet_resnet.py              # 2 processes (tiny ImageNet by default)
    python examples/imagenet_resnet.py --replicas 2           # 2 replicas in one process
    # Ctrl-C stops after the current step and writes a checkpoint; the same command resumes.
    # Curves: runs/imagenet/curves.png, metrics: runs/imagenet/metrics.jsonl

The data comes from the dataset registry ``examples/datasets.toml``. Its
``tiny-imagenet`` entry is a small ImageNet-shaped tree of real JPEG files,
generated on first use; for the real ImageNet, point the ``imagenet`` entry at
your copy (a local path or an ``s3://`` URL) and run with
``--dataset imagenet --arch resnet50 --image-size 224 --batch-size 64 --epochs 90``.
"""

from __future__ import annotations

import argparse
import os

import torch

import phalanx
import phalanx.torch
import phalanx.train as pt
from phalanx.train import models

HERE = os.path.dirname(os.path.abspath(__file__))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--registry", default=os.path.join(HERE, "datasets.toml"))
    p.add_argument("--dataset", default="tiny-imagenet")
    p.add_argument("--arch", default="resnet_tiny", choices=["resnet_tiny", "resnet18", "resnet34", "resnet50"])
    p.add_argument("--image-size", type=int, default=56)
    p.add_argument("--epochs", type=int, default=6)
    p.add_argument("--steps", type=int, default=None, help="stop after this many steps (default: epochs)")
    p.add_argument("--batch-size", type=int, default=16, help="per worker (process or replica)")
    p.add_argument("--lr", type=float, default=0.1, help="for a global batch of 256 (scaled linearly)")
    p.add_argument("--replicas", type=int, default=None, help="model replicas per process")
    p.add_argument("--workers", type=int, default=2, help="DataLoader worker processes per rank")
    p.add_argument("--precision", choices=["bf16", "fp16"], default=None)
    p.add_argument("--out", default="runs/imagenet", help="checkpoints, metrics and curves")
    p.add_argument("--fresh", action="store_true", help="do not resume from --out's latest checkpoint")
    p.add_argument("--tensorboard", action="store_true")
    args = p.parse_args()

    phalanx.init()
    torch.manual_seed(0)
    registry = pt.load_registry(args.registry)
    if args.dataset == "tiny-imagenet":
        if phalanx.rank() == 0:  # one writer; the others wait below
            pt.make_tiny_imagenet(registry.entry("tiny-imagenet")["path"], classes=10, train_per_class=48,
                                  val_per_class=12)
        phalanx.barrier()
    resize = round(args.image_size * 256 / 224)
    train_set = registry.open(args.dataset, "train", transform=pt.train_transform(args.image_size))
    val_set = registry.open(args.dataset, "val", transform=pt.eval_transform(args.image_size, resize=resize))

    model = getattr(models, args.arch)(num_classes=len(train_set.classes))
    if args.replicas is None:  # BatchNorm statistics over the global batch (replicas keep replica 0's)
        model = phalanx.torch.convert_sync_batchnorm(model)
    workers = phalanx.size() * (args.replicas or 1)
    lr = args.lr * args.batch_size * workers / 256
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9, weight_decay=1e-4, nesterov=True)
    steps_per_epoch = len(train_set) // (args.batch_size * workers)
    total = args.steps or args.epochs * steps_per_epoch

    loggers: list[pt.Logger] = [pt.JSONLinesLogger(os.path.join(args.out, "metrics.jsonl"))]
    if args.tensorboard:
        loggers.append(pt.TensorBoardLogger(os.path.join(args.out, "tensorboard")))
    history = pt.fit(
        model, torch.nn.functional.cross_entropy, optimizer, train_set,
        batch_size=args.batch_size, epochs=args.epochs, steps=args.steps,
        val_data=val_set, topk=(1, 5),
        scheduler=lambda opt: torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=lr, total_steps=total),
        precision=args.precision, replicas=args.replicas, num_workers=args.workers,
        checkpoint_dir=args.out, resume=None if args.fresh else "latest", loggers=loggers, log_every=5)
    if phalanx.rank() == 0 and history.stopped is None:
        print(f"val top-1 {history.last('val/top1'):.3f}, top-5 {history.last('val/top5'):.3f} "
              f"after {history.summary['steps']} steps; curves in {history.summary.get('curves')}")


if __name__ == "__main__":
    main()

"""Horovod's PyTorch synthetic benchmark, on phalanx: the script differs from Horovod's only in its import.

::

    phalanx run -np 2 examples/horovod/synthetic_benchmark.py --fp16-allreduce
    phalanx run -np 2 examples/horovod/synthetic_benchmark.py --batches-per-allreduce 2

Written the way ``examples/pytorch/pytorch_synthetic_benchmark.py`` in Horovod
is (argparse, ``hvd.init()``, ``DistributedOptimizer`` with
``named_parameters``, ``broadcast_parameters`` and ``broadcast_optimizer_state``,
``Compression.fp16``, ``timeit`` of ``benchmark_step``), with a small model
built here instead of torchvision's, so it needs nothing but torch. The fixed
fake batch is the same global batch at any number of ranks (each rank takes its
``--batch-size`` slice of ``size() * --batch-size`` samples made from
``--seed``), so ``--save-model`` of 2 ranks at ``--batch-size B --lr L`` equals
1 rank at ``--batch-size 2B --lr 2L`` (the learning rate is scaled by ``hvd.size()``).
"""

# ruff: noqa: UP004, UP008, UP031, UP032  # the str.format/% and super(C, self) style of Horovod's examples

import argparse
import timeit

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.optim as optim
import torch.utils.data.distributed

import phalanx.horovod.torch as hvd

# Benchmark settings
parser = argparse.ArgumentParser(description='PyTorch Synthetic Benchmark',
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
parser.add_argument('--fp16-allreduce', action='store_true', default=False,
                    help='use fp16 compression during allreduce')
parser.add_argument('--batches-per-allreduce', type=int, default=1,
                    help='number of batches processed locally before executing allreduce across workers')

parser.add_argument('--model', type=str, default='convnet', choices=['convnet', 'mlp'],
                    help='model to benchmark')
parser.add_argument('--batch-size', type=int, default=32,
                    help='input batch size')
parser.add_argument('--lr', type=float, default=0.01,
                    help='learning rate of one worker (scaled by the number of workers)')
parser.add_argument('--image-size', type=int, default=32,
                    help='height and width of the fake images')

parser.add_argument('--num-warmup-batches', type=int, default=10,
                    help='number of warm-up batches that don\'t count towards benchmark')
parser.add_argument('--num-batches-per-iter', type=int, default=10,
                    help='number of batches per benchmark iteration')
parser.add_argument('--num-iters', type=int, default=10,
                    help='number of benchmark iterations')

parser.add_argument('--no-cuda', action='store_true', default=False,
                    help='disables CUDA training')
parser.add_argument('--use-adasum', action='store_true', default=False,
                    help='use adasum algorithm to do reduction')
parser.add_argument('--seed', type=int, default=42,
                    help='random seed of the model and of the fake data')
parser.add_argument('--save-model', default=None,
                    help='rank 0 saves the trained model\'s state_dict here')

args = parser.parse_args()
args.cuda = not args.no_cuda and torch.cuda.is_available()

hvd.init()

if args.cuda:
    # Horovod: pin GPU to local rank.
    torch.cuda.set_device(hvd.local_rank())


def convnet(norm_layer):
    return nn.Sequential(
        nn.Conv2d(3, 16, 3, padding=1, bias=False), norm_layer(16), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(16, 32, 3, padding=1, bias=False), norm_layer(32), nn.ReLU(), nn.MaxPool2d(2),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(32, 1000))


def mlp(norm_layer):
    size = 3 * args.image_size * args.image_size
    return nn.Sequential(nn.Flatten(), nn.Linear(size, 256), nn.ReLU(), nn.Linear(256, 1000))


# Set up standard model (the same weights on every rank before the broadcast, too).
torch.manual_seed(args.seed)
model = {'convnet': convnet, 'mlp': mlp}[args.model](norm_layer=hvd.SyncBatchNorm)

# By default, Adasum doesn't need scaling up learning rate.
lr_scaler = hvd.size() if not args.use_adasum else 1

if args.cuda:
    # Move model to GPU.
    model.cuda()

optimizer = optim.SGD(model.parameters(), lr=args.lr * lr_scaler, momentum=0.9)

# Horovod: (optional) compression algorithm.
compression = hvd.Compression.fp16 if args.fp16_allreduce else hvd.Compression.none

# Horovod: wrap optimizer with DistributedOptimizer.
optimizer = hvd.DistributedOptimizer(optimizer,
                                     named_parameters=model.named_parameters(),
                                     compression=compression,
                                     backward_passes_per_step=args.batches_per_allreduce,
                                     op=hvd.Adasum if args.use_adasum else hvd.Average)

# Horovod: broadcast parameters & optimizer state.
hvd.broadcast_parameters(model.state_dict(), root_rank=0)
hvd.broadcast_optimizer_state(optimizer, root_rank=0)

# Set up fixed fake data: one global batch per local pass, this rank's slice of it.
generator = torch.Generator().manual_seed(args.seed)
total = args.batch_size * hvd.size()
mine = slice(hvd.rank() * args.batch_size, (hvd.rank() + 1) * args.batch_size)
data, target = [], []
for _ in range(args.batches_per_allreduce):
    data.append(torch.randn(total, 3, args.image_size, args.image_size, generator=generator)[mine])
    target.append(torch.randint(0, 1000, (total,), generator=generator)[mine])
if args.cuda:
    data, target = [d.cuda() for d in data], [t.cuda() for t in target]


def benchmark_step():
    optimizer.zero_grad()
    for data_batch, target_batch in zip(data, target, strict=True):
        output = model(data_batch)
        loss = F.cross_entropy(output, target_batch)
        # Average gradients among the local batches
        loss.div_(args.batches_per_allreduce)
        loss.backward()
    optimizer.step()


def log(s, nl=True):
    if hvd.rank() != 0:
        return
    print(s, end='\n' if nl else '')


log('Model: %s' % args.model)
log('Batch size: %d' % args.batch_size)
device = 'GPU' if args.cuda else 'CPU'
log('Number of %ss: %d' % (device, hvd.size()))

# Warm-up
log('Running warmup...')
timeit.timeit(benchmark_step, number=args.num_warmup_batches)

# Benchmark
log('Running benchmark...')
img_secs = []
for x in range(args.num_iters):
    time = timeit.timeit(benchmark_step, number=args.num_batches_per_iter)
    img_sec = args.batch_size * args.batches_per_allreduce * args.num_batches_per_iter / time
    log('Iter #%d: %.1f img/sec per %s' % (x, img_sec, device))
    img_secs.append(img_sec)

# Results
img_sec_mean = np.mean(img_secs)
img_sec_conf = 1.96 * np.std(img_secs)
log('Img/sec per %s: %.1f +-%.1f' % (device, img_sec_mean, img_sec_conf))
log('Total img/sec on %d %s(s): %.1f +-%.1f' %
    (hvd.size(), device, hvd.size() * img_sec_mean, hvd.size() * img_sec_conf))

if args.save_model and hvd.rank() == 0:
    torch.save(model.state_dict(), args.save_model)

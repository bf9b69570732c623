"""Horovod's PyTorch ImageNet ResNet example, on phalanx: the script differs from Horovod's only in its import.

::

    phalanx run -np 2 examples/horovod/imagenet_resnet.py --epochs 4 --checkpoint-format 'ckpt/checkpoint-{epoch}.pth.tar'
    # run it again with --epochs 6: rank 0 finds checkpoint-4, broadcasts the epoch, and training goes on from there

Written the way ``examples/pytorch/pytorch_imagenet_resnet50.py`` in Horovod
is: the learning rate is ``--base-lr × hvd.size() × --batches-per-allreduce``,
reached by a linear warm-up over ``--warmup-epochs`` that starts at ``--base-lr``
(Goyal et al., 2017) and then decays by 10 at ``--lr-decay-epochs``; local
gradient accumulation (``backward_passes_per_step``); metrics averaged through
``hvd.allreduce``; a checkpoint per epoch written by rank 0; on start, rank 0
looks for the newest checkpoint, broadcasts its epoch, loads it, and
``broadcast_parameters``/``broadcast_optimizer_state`` give every rank its
weights and momentum. The model is a small ResNet (basic blocks, 16/32/64
channels) built here, the data are ImageNet-style 3×32×32 images of 10
classes generated from ``--data-seed``, so it needs nothing but torch.
With ``--sync-bn`` (``hvd.SyncBatchNorm``) and ``--warmup-epochs 0``, 2 ranks at
``--batch-size B`` train the same model as 1 rank at ``--batch-size 2B
--base-lr 2×``, and a job resumed from its checkpoint ends where one that ran
straight through does.
"""

# ruff: noqa: UP004, UP008, UP031, UP032  # the str.format/% and super(C, self) style of Horovod's examples

import argparse
import math
import os

import torch
import torch.backends.cudnn as cudnn
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F
import torch.optim as optim
import torch.utils.data.distributed

import phalanx.horovod.torch as hvd

# Training settings
parser = argparse.ArgumentParser(description='PyTorch ImageNet Example',
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
parser.add_argument('--checkpoint-format', default='./checkpoint-{epoch}.pth.tar',
                    help='checkpoint file format')
parser.add_argument('--fp16-allreduce', action='store_true', default=False,
                    help='use fp16 compression during allreduce')
parser.add_argument('--batches-per-allreduce', type=int, default=1,
                    help='number of batches processed locally before '
                         'executing allreduce across workers; it multiplies '
                         'total batch size.')
parser.add_argument('--use-adasum', action='store_true', default=False,
                    help='use adasum algorithm to do reduction')
parser.add_argument('--gradient-predivide-factor', type=float, default=1.0,
                    help='apply gradient predivide factor in optimizer (default: 1.0)')
parser.add_argument('--sync-bn', action='store_true', default=False,
                    help='use hvd.SyncBatchNorm: batch statistics over all ranks')

# Default settings from https://arxiv.org/abs/1706.02677, scaled to a small job.
parser.add_argument('--batch-size', type=int, default=32,
                    help='input batch size for training')
parser.add_argument('--val-batch-size', type=int, default=32,
                    help='input batch size for validation')
parser.add_argument('--epochs', type=int, default=8,
                    help='number of epochs to train')
parser.add_argument('--base-lr', type=float, default=0.0125,
                    help='learning rate for a single GPU')
parser.add_argument('--warmup-epochs', type=float, default=2,
                    help='number of warmup epochs')
parser.add_argument('--lr-decay-epochs', default='4,6,7',
                    help='epochs after which the learning rate is divided by 10')
parser.add_argument('--momentum', type=float, default=0.9,
                    help='SGD momentum')
parser.add_argument('--wd', type=float, default=0.00005,
                    help='weight decay')
parser.add_argument('--train-size', type=int, default=512,
                    help='number of generated training images')
parser.add_argument('--val-size', type=int, default=128,
                    help='number of generated validation images')
parser.add_argument('--data-seed', type=int, default=0,
                    help='seed of the generated data')

parser.add_argument('--no-cuda', action='store_true', default=False,
                    help='disables CUDA training')
parser.add_argument('--seed', type=int, default=42,
                    help='random seed')


class BasicBlock(nn.Module):
    def __init__(self, inplanes, planes, stride, norm_layer):
        super(BasicBlock, self).__init__()
        self.conv1 = nn.Conv2d(inplanes, planes, 3, stride=stride, padding=1, bias=False)
        self.bn1 = norm_layer(planes)
        self.conv2 = nn.Conv2d(planes, planes, 3, padding=1, bias=False)
        self.bn2 = norm_layer(planes)
        self.downsample = None
        if stride != 1 or inplanes != planes:
            self.downsample = nn.Sequential(nn.Conv2d(inplanes, planes, 1, stride=stride, bias=False),
                                            norm_layer(planes))

    def forward(self, x):
        identity = x if self.downsample is None else self.downsample(x)
        out = F.relu(self.bn1(self.conv1(x)))
        return F.relu(self.bn2(self.conv2(out)) + identity)


class ResNet(nn.Module):
    def __init__(self, num_classes=10, widths=(16, 32, 64), norm_layer=nn.BatchNorm2d):
        super(ResNet, self).__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, widths[0], 3, padding=1, bias=False),
                                  norm_layer(widths[0]), nn.ReLU())
        blocks, inplanes = [], widths[0]
        for i, planes in enumerate(widths):
            blocks.append(BasicBlock(inplanes, planes, 1 if i == 0 else 2, norm_layer))
            inplanes = planes
        self.layers = nn.Sequential(*blocks)
        self.fc = nn.Linear(inplanes, num_classes)

    def forward(self, x):
        x = self.layers(self.stem(x))
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1))


def generated_imagenet(size, seed, train):
    """ImageNet-style data: ``size`` normalized 3×32×32 images of 10 classes, the same on every rank."""
    generator = torch.Generator().manual_seed(seed)
    patterns = torch.rand(10, 3, 32, 32, generator=generator)
    generator.manual_seed(seed + (1 if train else 2))
    labels = torch.randint(0, 10, (size,), generator=generator)
    images = 0.4 * patterns[labels] + 0.6 * torch.rand(size, 3, 32, 32, generator=generator)
    mean = torch.tensor([0.485, 0.456, 0.406]).view(3, 1, 1)
    std = torch.tensor([0.229, 0.224, 0.225]).view(3, 1, 1)
    return torch.utils.data.TensorDataset((images - mean) / std, labels)


def train(epoch):
    model.train()
    train_sampler.set_epoch(epoch)
    train_loss = Metric('train_loss')
    train_accuracy = Metric('train_accuracy')
    lrs = []

    for batch_idx, (data, target) in enumerate(train_loader):
        lrs.append(adjust_learning_rate(epoch, batch_idx))

        if args.cuda:
            data, target = data.cuda(), target.cuda()
        optimizer.zero_grad()
        # Split data into sub-batches of size batch_size
        for i in range(0, len(data), args.batch_size):
            data_batch = data[i:i + args.batch_size]
            target_batch = target[i:i + args.batch_size]
            output = model(data_batch)
            train_accuracy.update(accuracy(output, target_batch))
            loss = F.cross_entropy(output, target_batch)
            train_loss.update(loss)
            # Average gradients among sub-batches
            loss.div_(math.ceil(float(len(data)) / args.batch_size))
            loss.backward()
        # Gradient is applied across all ranks
        optimizer.step()

    if verbose:
        print('Train Epoch     #{}: loss {:.4f}, accuracy {:.2f}%, lr {:.6f} -> {:.6f}'.format(
            epoch + 1, train_loss.avg.item(), 100. * train_accuracy.avg.item(), lrs[0], lrs[-1]), flush=True)


def validate(epoch):
    model.eval()
    val_loss = Metric('val_loss')
    val_accuracy = Metric('val_accuracy')

    with torch.no_grad():
        for data, target in val_loader:
            if args.cuda:
                data, target = data.cuda(), target.cuda()
            output = model(data)

            val_loss.update(F.cross_entropy(output, target))
            val_accuracy.update(accuracy(output, target))

    if verbose:
        print('Validate Epoch  #{}: loss {:.4f}, accuracy {:.2f}%'.format(
            epoch + 1, val_loss.avg.item(), 100. * val_accuracy.avg.item()), flush=True)


# Horovod: using `lr = base_lr * hvd.size()` from the very beginning leads to worse final
# accuracy. Scale the learning rate `lr = base_lr` ---> `lr = base_lr * hvd.size()` during
# the first --warmup-epochs epochs. See https://arxiv.org/abs/1706.02677 for details.
# After the warmup reduce learning rate by 10 after each of --lr-decay-epochs.
def adjust_learning_rate(epoch, batch_idx):
    if epoch < args.warmup_epochs:
        epoch += float(batch_idx + 1) / len(train_loader)
        lr_adj = 1. / hvd.size() * (epoch * (hvd.size() - 1) / args.warmup_epochs + 1)
    else:
        lr_adj = 0.1 ** sum(epoch >= milestone for milestone in lr_decay_epochs)
    for param_group in optimizer.param_groups:
        param_group['lr'] = args.base_lr * hvd.size() * args.batches_per_allreduce * lr_adj
    return args.base_lr * hvd.size() * args.batches_per_allreduce * lr_adj


def accuracy(output, target):
    # get the index of the max log-probability
    pred = output.max(1, keepdim=True)[1]
    return pred.eq(target.view_as(pred)).cpu().float().mean()


def save_checkpoint(epoch):
    if hvd.rank() == 0:
        filepath = args.checkpoint_format.format(epoch=epoch + 1)
        os.makedirs(os.path.dirname(filepath) or '.', exist_ok=True)
        state = {
            'model': model.state_dict(),
            'optimizer': optimizer.state_dict(),
        }
        torch.save(state, filepath)


# Horovod: average metrics from distributed training.
class Metric(object):
    def __init__(self, name):
        self.name = name
        self.sum = torch.tensor(0.)
        self.n = torch.tensor(0.)

    def update(self, val):
        self.sum += hvd.allreduce(val.detach().cpu(), name=self.name)
        self.n += 1

    @property
    def avg(self):
        return self.sum / self.n


if __name__ == '__main__':
    args = parser.parse_args()
    args.cuda = not args.no_cuda and torch.cuda.is_available()
    lr_decay_epochs = [int(e) for e in args.lr_decay_epochs.split(',') if e]

    allreduce_batch_size = args.batch_size * args.batches_per_allreduce

    hvd.init()
    torch.manual_seed(args.seed)

    if args.cuda:
        # Horovod: pin GPU to local rank.
        torch.cuda.set_device(hvd.local_rank())
        torch.cuda.manual_seed(args.seed)

    cudnn.benchmark = True

    # If set > 0, will resume training from a given checkpoint.
    resume_from_epoch = 0
    for try_epoch in range(args.epochs, 0, -1):
        if os.path.exists(args.checkpoint_format.format(epoch=try_epoch)):
            resume_from_epoch = try_epoch
            break

    # Horovod: broadcast resume_from_epoch from rank 0 (which will have
    # checkpoints) to other ranks.
    resume_from_epoch = hvd.broadcast(torch.tensor(resume_from_epoch), root_rank=0,
                                      name='resume_from_epoch').item()

    # Horovod: print logs on the first worker.
    verbose = 1 if hvd.rank() == 0 else 0
    if verbose and resume_from_epoch > 0:
        print('Resuming from epoch {}'.format(resume_from_epoch), flush=True)

    # Horovod: limit # of CPU threads to be used per worker.
    torch.set_num_threads(1)

    kwargs = {'num_workers': 4, 'pin_memory': True} if args.cuda else {}
    # When supported, use 'forkserver' to spawn dataloader workers instead of 'fork' to prevent
    # issues with Infiniband implementations that are not fork-safe
    if (kwargs.get('num_workers', 0) > 0 and hasattr(mp, '_supports_context') and
            mp._supports_context and 'forkserver' in mp.get_all_start_methods()):
        kwargs['multiprocessing_context'] = 'forkserver'

    train_dataset = generated_imagenet(args.train_size, args.data_seed, train=True)
    # Horovod: use DistributedSampler to partition data among workers. Manually specify
    # `num_replicas=hvd.size()` and `rank=hvd.rank()`.
    train_sampler = torch.utils.data.distributed.DistributedSampler(
        train_dataset, num_replicas=hvd.size(), rank=hvd.rank())
    train_loader = torch.utils.data.DataLoader(
        train_dataset, batch_size=allreduce_batch_size,
        sampler=train_sampler, **kwargs)

    val_dataset = generated_imagenet(args.val_size, args.data_seed, train=False)
    val_sampler = torch.utils.data.distributed.DistributedSampler(
        val_dataset, num_replicas=hvd.size(), rank=hvd.rank())
    val_loader = torch.utils.data.DataLoader(val_dataset, batch_size=args.val_batch_size,
                                             sampler=val_sampler, **kwargs)

    # Set up the ResNet.
    model = ResNet(norm_layer=hvd.SyncBatchNorm if args.sync_bn else nn.BatchNorm2d)

    # By default, Adasum doesn't need scaling up learning rate.
    # For sum/average with gradient Accumulation: scale learning rate by batches_per_allreduce
    lr_scaler = args.batches_per_allreduce * hvd.size() if not args.use_adasum else 1

    if args.cuda:
        # Move model to GPU.
        model.cuda()
        # If using GPU Adasum allreduce, scale learning rate by local_size.
        if args.use_adasum and hvd.nccl_built():
            lr_scaler = args.batches_per_allreduce * hvd.local_size()

    # Horovod: scale learning rate by the number of GPUs.
    optimizer = optim.SGD(model.parameters(),
                          lr=(args.base_lr *
                              lr_scaler),
                          momentum=args.momentum, weight_decay=args.wd)

    # Horovod: (optional) compression algorithm.
    compression = hvd.Compression.fp16 if args.fp16_allreduce else hvd.Compression.none

    # Horovod: wrap optimizer with DistributedOptimizer.
    optimizer = hvd.DistributedOptimizer(
        optimizer, named_parameters=model.named_parameters(),
        compression=compression,
        backward_passes_per_step=args.batches_per_allreduce,
        op=hvd.Adasum if args.use_adasum else hvd.Average,
        gradient_predivide_factor=args.gradient_predivide_factor)

    # Restore from a previous checkpoint, if initial_epoch is specified.
    # Horovod: restore on the first worker which will broadcast weights to other workers.
    if resume_from_epoch > 0 and hvd.rank() == 0:
        filepath = args.checkpoint_format.format(epoch=resume_from_epoch)
        checkpoint = torch.load(filepath)
        model.load_state_dict(checkpoint['model'])
        optimizer.load_state_dict(checkpoint['optimizer'])

    # Horovod: broadcast parameters & optimizer state.
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)

    for epoch in range(resume_from_epoch, args.epochs):
        train(epoch)
        validate(epoch)
        save_checkpoint(epoch)

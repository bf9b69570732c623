"""phalanx.torch: the PyTorch adapter (importing it imports torch).

::

    import phalanx, phalanx.torch
    sampler = phalanx.torch.DistributedSampler(dataset, seed=0)
    opt = phalanx.torch.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    model = phalanx.torch.DataParallel(phalanx.torch.convert_sync_batchnorm(model))  # or this
"""

from __future__ import annotations

# sharded checkpoints' conversion to and from torch's DCP; training over slow links (DiLoCo, Streaming
# DiLoCo, LocalSGD; Quantize below: their outer-gradient compression); the sharded export
from ._dcp import convert_checkpoint
from ._diloco import DiLoCo, LocalSGD
from ._export import export_safetensors, load_safetensors

# gradient reduction (DistributedOptimizer, DataParallel)
from ._optimizer import DistributedOptimizer
from ._outer_compress import Quantize
from ._parallel import DataParallel

# torch.distributed's "phalanx" backend
from ._pg_setup import init_process_group
from ._powersgd import PowerSGD

# in-process replicas (replicate, Replicas, withdevices)
from ._replicas import Replicas, replicate, withdevices

# data loading (DistributedSampler, dataloader_context)
from ._sampler import DistributedSampler, dataloader_context
from ._scaler import ShardedGradScaler
from ._shard_tensor import ShardedTensor, ShardSpec, shard_of
from ._sharded_checkpoint import load_sharded, save_sharded

# SyncBatchNorm
from ._syncbn import SyncBatchNorm, convert_sync_batchnorm

__all__ = [
    # data loading
    "DistributedSampler",
    "dataloader_context",
    # gradient reduction and SyncBatchNorm
    "DataParallel",
    "DistributedOptimizer",
    "PowerSGD",
    "ShardSpec",
    "ShardedGradScaler",
    "ShardedTensor",
    "SyncBatchNorm",
    "convert_checkpoint",
    "convert_sync_batchnorm",
    "export_safetensors",
    "init_process_group",
    "load_safetensors",
    "load_sharded",
    "save_sharded",
    "shard_of",
    # training over slow links
    "DiLoCo",
    "LocalSGD",
    "Quantize",
    # in-process replicas
    "Replicas",
    "replicate",
    "withdevices",
]

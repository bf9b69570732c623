"""``phalanx.torch.SyncBatchNorm``: batch normalization over the whole global batch, on any backend.

::

    model = phalanx.torch.convert_sync_batchnorm(model)   # every BatchNorm*d becomes SyncBatchNorm
    model = phalanx.torch.DataParallel(model)

The arithmetic is in ``docs/design.md`` ("SyncBatchNorm").
"""

from __future__ import annotations

from typing import Any

import torch
from torch.autograd.function import once_differentiable
from torch.nn.modules.batchnorm import _BatchNorm

from .._collectives import allreduce
from .._errors import InvalidArgumentError

__all__ = ["SyncBatchNorm", "convert_sync_batchnorm"]


def _shape(x: torch.Tensor) -> list[int]:
    return [1, x.shape[1]] + [1] * (x.dim() - 2)


class _SyncBatchNormFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None,
                running_mean: torch.Tensor | None, running_var: torch.Tensor | None, eps: float,
                momentum: float) -> torch.Tensor:
        channels = x.shape[1]
        dims = [0, *range(2, x.dim())]
        local = x.numel() // channels if channels else 0
        stats = torch.zeros(2 * channels + 1, dtype=torch.float64, device=x.device)
        if local:
            var, mean = torch.var_mean(x, dim=dims, correction=0)
            mean64 = mean.double()
            stats[:channels] = mean64 * local
            stats[channels:2 * channels] = (var.double() + mean64 * mean64) * local
        stats[-1] = local
        allreduce(stats)
        count = stats[-1].item()
        if count <= 1:
            raise InvalidArgumentError(
                f"phalanx.torch.SyncBatchNorm: expected more than 1 value per channel when training, got "
                f"{int(count)} over all ranks (input shape {list(x.shape)} on this rank). Use a larger "
                "batch, or call model.eval() to normalize with the running statistics.")
        mean64 = stats[:channels] / count
        var64 = (stats[channels:2 * channels] / count - mean64 * mean64).clamp_(min=0)
        if running_mean is not None and running_var is not None:
            running_mean.mul_(1 - momentum).add_(mean64.to(running_mean.dtype), alpha=momentum)
            unbiased = var64 * (count / (count - 1))
            running_var.mul_(1 - momentum).add_(unbiased.to(running_var.dtype), alpha=momentum)
        mean = mean64.to(x.dtype)
        invstd = torch.rsqrt(var64 + eps).to(x.dtype)
        shape = _shape(x)
        y = (x - mean.view(shape)) * invstd.view(shape)
        if weight is not None:
            y = y * weight.view(shape)
        if bias is not None:
            y = y + bias.view(shape)
        ctx.save_for_backward(x, weight, mean, invstd)
        ctx.count = count
        return y

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, dy: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, weight, mean, invstd = ctx.saved_tensors
        channels = x.shape[1]
        shape = _shape(x)
        dims = [0, *range(2, x.dim())]
        dy = dy.contiguous()
        xhat = (x - mean.view(shape)) * invstd.view(shape)
        sum_dy = dy.sum(dims)
        sum_dy_xhat = (dy * xhat).sum(dims)
        dx = None
        if ctx.needs_input_grad[0]:
            sums = torch.cat([sum_dy, sum_dy_xhat]).double()
            allreduce(sums)
            mean_dy = (sums[:channels] / ctx.count).to(x.dtype)
            mean_dy_xhat = (sums[channels:] / ctx.count).to(x.dtype)
            scale = invstd if weight is None else invstd * weight
            dx = (dy - mean_dy.view(shape) - xhat * mean_dy_xhat.view(shape)) * scale.view(shape)
        dweight = sum_dy_xhat if weight is not None and ctx.needs_input_grad[1] else None
        dbias = sum_dy if ctx.needs_input_grad[2] else None
        return dx, dweight, dbias, None, None, None, None


class SyncBatchNorm(_BatchNorm):
    """Batch normalization whose training-mode statistics are those of the batch of *all* ranks together.

    ::

        model = phalanx.torch.convert_sync_batchnorm(model)   # every BatchNorm*d becomes SyncBatchNorm

    In training mode, forward reduces each channel's sum, sum of squares and
    count (one small ``phalanx.allreduce``, in float64) and backward reduces
    the sums of ``grad_output`` and ``grad_output * x_hat`` (another one), so
    N ranks train exactly like one process on the concatenated batch. Ranks
    may hold different batch sizes, even empty ones. Running statistics are
    updated as torch does (unbiased ``running_var``), identically on every
    rank. Eval mode is plain batch norm with no communication, so rank 0 may
    evaluate alone. Every rank must run the same training-mode forward and
    backward passes through the layer (each is a collective).

    Arguments (those of ``torch.nn.BatchNorm2d``; one class for 1d, 2d and 3d inputs ``(N, C, *)``):
        num_features: C, the number of channels.
        eps, momentum: as torch (``momentum=None``: a cumulative average).
        affine, track_running_stats: as torch.
        device, dtype: of the parameters and buffers.

    Raises:
        InvalidArgumentError: an input with fewer than 2 dimensions, or a
            training batch with at most one value per channel over all ranks.
    """

    def _check_input_dim(self, input: torch.Tensor) -> None:
        if input.dim() < 2:
            raise InvalidArgumentError(
                f"phalanx.torch.SyncBatchNorm: expected an input of shape (N, C, ...), got a "
                f"{input.dim()}-d input of shape {list(input.shape)}. Add the batch dimension "
                "(x.unsqueeze(0)) or the channel dimension.")

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        self._check_input_dim(input)
        momentum = 0.0 if self.momentum is None else self.momentum
        if self.training and self.track_running_stats and self.num_batches_tracked is not None:
            self.num_batches_tracked.add_(1)
            if self.momentum is None:  # cumulative moving average, as torch
                momentum = 1.0 / float(self.num_batches_tracked)
        use_batch_stats = self.training or (self.running_mean is None and self.running_var is None)
        if not use_batch_stats:
            return torch.nn.functional.batch_norm(input, self.running_mean, self.running_var, self.weight,
                                                  self.bias, False, 0.0, self.eps)
        track = not self.training or self.track_running_stats
        return _SyncBatchNormFunction.apply(input, self.weight, self.bias,
                                            self.running_mean if track else None,
                                            self.running_var if track else None, self.eps, momentum)


def convert_sync_batchnorm(module: torch.nn.Module) -> torch.nn.Module:
    """``module`` with every batch-norm layer replaced by a :class:`SyncBatchNorm` sharing its tensors.

    Arguments:
        module: a model; every ``BatchNorm1d/2d/3d`` (any ``_BatchNorm``) in it,
            or ``module`` itself, is replaced, keeping its parameters, running
            statistics, training flag and ``qconfig``.

    Returns:
        ``module`` with its children replaced in place, or a new
        :class:`SyncBatchNorm` if ``module`` itself is a batch-norm layer.
    """
    converted = module
    if isinstance(module, _BatchNorm) and not isinstance(module, SyncBatchNorm):
        converted = SyncBatchNorm(module.num_features, module.eps, module.momentum, module.affine,
                                  module.track_running_stats, device="meta")
        if module.affine:
            converted.weight = module.weight
            converted.bias = module.bias
        converted.running_mean = module.running_mean
        converted.running_var = module.running_var
        converted.num_batches_tracked = module.num_batches_tracked
        converted.train(module.training)
        if hasattr(module, "qconfig"):
            converted.qconfig = module.qconfig
    for name, child in module.named_children():
        converted.add_module(name, convert_sync_batchnorm(child))
    return converted

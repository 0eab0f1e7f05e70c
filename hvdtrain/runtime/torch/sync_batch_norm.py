"""Batch normalization over the global batch: in training, every BatchNorm layer's mean and variance
are those of all ranks' samples together, as if one process had normalized the whole batch.

Horovod's `hvd.SyncBatchNorm` and torch's `nn.SyncBatchNorm` do this on GPUs only (they call CUDA
kernels, and refuse CPU tensors: "expected input tensor to be on GPU"). So on a CPU the backends use
`SyncBatchNorm` here: the statistics are summed across ranks by an allreduce (Horovod's
or torch.distributed's all_reduce), and the backward pass sums the gradient's two projections the same
way, as the CUDA kernels do.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.nn.modules.batchnorm import _BatchNorm

SumAcrossRanks = Callable[[torch.Tensor, str], torch.Tensor]
"""(tensor, name) -> its sum over every rank (not differentiated: the backward below has its own)."""


class _GlobalBatchNorm(torch.autograd.Function):
    """Normalization by the global batch's statistics, with BatchNorm's own backward: the input's
    gradient projected off the constant and the normalized input, with the two projections summed
    over ranks. Autograd through the statistics would get the same in theory, but it adds up
    contributions that nearly cancel, and loses digits where a layer sees many samples per channel."""

    @staticmethod
    def forward(ctx, x, weight, bias, eps, sum_across_ranks, name):
        # Statistics accumulated in float64, and the output as x * scale + shift, as torch's own CPU
        # kernel has it: a ReLU then max-pool after the layer picks its maxima by the last digit.
        dims = [0, *range(2, x.dim())]
        shape = [1, -1, *([1] * (x.dim() - 2))]
        wide = x.double()
        local_count = torch.tensor([x.numel() / x.shape[1]], dtype=torch.float64, device=x.device)
        first = sum_across_ranks(torch.cat([wide.sum(dims), local_count]), f"{name}.sum")
        count = first[-1]
        mean = first[:-1] / count
        centred = wide - mean.view(shape)
        var = sum_across_ranks((centred * centred).sum(dims), f"{name}.var") / count
        invstd = torch.rsqrt(var + eps).to(x.dtype)
        mean, var = mean.to(x.dtype), var.to(x.dtype)
        scale = invstd if weight is None else invstd * weight
        shift = -mean * scale if bias is None else bias - mean * scale
        out = x * scale.view(shape) + shift.view(shape)
        normalized = (x - mean.view(shape)) * invstd.view(shape)
        ctx.save_for_backward(normalized, invstd, weight)
        ctx.count, ctx.sum_across_ranks, ctx.name = count, sum_across_ranks, name
        ctx.mark_non_differentiable(mean, var)
        return out, mean, var, count.to(x.dtype)

    @staticmethod
    def backward(ctx, grad_out, _mean, _var, _count):
        normalized, invstd, weight = ctx.saved_tensors
        dims = [0, *range(2, grad_out.dim())]
        shape = [1, -1, *([1] * (grad_out.dim() - 2))]
        sum_dy = grad_out.double().sum(dims)
        sum_dy_normalized = (grad_out.double() * normalized).sum(dims)
        both = ctx.sum_across_ranks(torch.cat([sum_dy, sum_dy_normalized]), f"{ctx.name}.grad")
        mean_dy, mean_dy_normalized = (both / ctx.count).to(grad_out.dtype).chunk(2)
        scale = invstd if weight is None else invstd * weight
        grad_in = (grad_out - mean_dy.view(shape) - normalized * mean_dy_normalized.view(shape)) * scale.view(
            shape
        )
        # this rank's own share of the affine parameters' gradients: the optimizer averages them
        grad_weight = None if weight is None else sum_dy_normalized.to(grad_out.dtype)
        grad_bias = None if weight is None else sum_dy.to(grad_out.dtype)
        return grad_in, grad_weight, grad_bias, None, None, None


class SyncBatchNorm(_BatchNorm):
    """BatchNorm1d/2d/3d whose training statistics are the global batch's: three collectives a layer
    and step (the sum and count, then the centred sum of squares, then in the backward pass the two
    sums of the gradient); the one-pass form of the variance, E[x^2] - E[x]^2, would lose digits
    where the mean is large against the spread."""

    def __init__(self, original: _BatchNorm, sum_across_ranks: SumAcrossRanks, name: str) -> None:
        super().__init__(
            original.num_features,
            original.eps,
            original.momentum,
            original.affine,
            original.track_running_stats,
        )
        self.sum_across_ranks, self.collective = sum_across_ranks, name
        _take_state(self, original)

    def _check_input_dim(self, input: torch.Tensor) -> None:
        if input.dim() < 2:
            raise ValueError(f"expected at least 2D input (got {input.dim()}D input)")

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        self._check_input_dim(input)
        if not self.training:
            return super().forward(input)
        x = input if input.dtype == torch.float64 else input.float()
        weight, bias = (self.weight, self.bias) if self.affine else (None, None)
        out, mean, var, count = _GlobalBatchNorm.apply(
            x, weight, bias, self.eps, self.sum_across_ranks, self.collective
        )
        if self.track_running_stats:
            with torch.no_grad():
                self.num_batches_tracked.add_(1)
                momentum = 1.0 / float(self.num_batches_tracked) if self.momentum is None else self.momentum
                unbiased = var * count / (count - 1).clamp(min=1)
                self.running_mean.mul_(1 - momentum).add_(mean, alpha=momentum)
                self.running_var.mul_(1 - momentum).add_(unbiased, alpha=momentum)
        return out.to(input.dtype)


def convert(model: torch.nn.Module, make: Callable[[_BatchNorm, str], torch.nn.Module]) -> torch.nn.Module:
    """`model` with every BatchNorm layer replaced by make(layer, its name), in place where it is not
    itself one; the layers keep their Parameter objects and buffers."""
    if isinstance(model, _BatchNorm):
        return make(model, "bn")
    for name, module in list(model.named_modules()):
        for child_name, child in list(module.named_children()):
            if isinstance(child, _BatchNorm) and not isinstance(child, SyncBatchNorm):
                full = f"{name}.{child_name}" if name else child_name
                setattr(module, child_name, make(child, full))
    return model


def for_horovod(model: torch.nn.Module, device: torch.device) -> torch.nn.Module:
    import horovod.torch as hvd

    if device.type == "cuda":
        return convert(model, lambda layer, name: _horovod_cuda(hvd, layer))

    def summed(tensor: torch.Tensor, name: str) -> torch.Tensor:
        return hvd.allreduce(tensor, op=hvd.Sum, name=f"hvdtrain.syncbn.{name}")

    return convert(model, lambda layer, name: SyncBatchNorm(layer, summed, name))


def _take_state(layer: _BatchNorm, original: _BatchNorm) -> _BatchNorm:
    """The same Parameter and buffer objects: an optimizer built over the model still holds them."""
    layer.weight, layer.bias = original.weight, original.bias
    layer.running_mean, layer.running_var = original.running_mean, original.running_var
    layer.num_batches_tracked = original.num_batches_tracked
    return layer.train(original.training)


def _horovod_cuda(hvd, layer: _BatchNorm) -> torch.nn.Module:
    synced = hvd.SyncBatchNorm(
        layer.num_features, layer.eps, layer.momentum, layer.affine, layer.track_running_stats
    )
    return _take_state(synced, layer)


def for_ddp(model: torch.nn.Module, device: torch.device) -> torch.nn.Module:
    if device.type == "cuda":
        return torch.nn.SyncBatchNorm.convert_sync_batchnorm(model)
    import torch.distributed as dist

    def summed(tensor: torch.Tensor, name: str) -> torch.Tensor:
        total = tensor.clone()
        dist.all_reduce(total)
        return total

    return convert(model, lambda layer, name: SyncBatchNorm(layer, summed, name))

"""The CPU SyncBatchNorm's arithmetic against torch's BatchNorm, in one process (the sum over one rank
is the tensor itself); tests/integration/test_equivalence.py checks 2 ranks x batch b against 1 process
x batch 2b."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from hvdtrain.models.resnet import ResNet  # noqa: E402
from hvdtrain.runtime.torch.sync_batch_norm import SyncBatchNorm, convert  # noqa: E402


def one_rank(tensor, name):
    return tensor


@pytest.mark.parametrize("shape", [(8, 3, 5, 5), (16, 4)])
def test_one_rank_normalizes_as_batchnorm_does_forward_backward_and_running_statistics(shape):
    torch.manual_seed(0)
    plain = torch.nn.BatchNorm2d(shape[1]) if len(shape) == 4 else torch.nn.BatchNorm1d(shape[1])
    with torch.no_grad():
        plain.weight.uniform_(0.5, 2)
        plain.bias.uniform_(-1, 1)
    twin = type(plain)(shape[1])
    twin.load_state_dict(plain.state_dict())
    synced = SyncBatchNorm(twin, one_rank, "bn")
    assert synced.weight is twin.weight and synced.running_var is twin.running_var
    x = (torch.randn(shape) * 3 + 10).requires_grad_()
    y = x.detach().clone().requires_grad_()
    for _ in range(3):
        expected, got = plain(x), synced(y)
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
        (expected * torch.arange(expected.numel()).view_as(expected)).sum().backward()
        (got * torch.arange(got.numel()).view_as(got)).sum().backward()
    torch.testing.assert_close(y.grad, x.grad, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(synced.weight.grad, plain.weight.grad, atol=1e-3, rtol=1e-5)
    for name in ("running_mean", "running_var", "num_batches_tracked"):
        torch.testing.assert_close(getattr(synced, name), getattr(plain, name), atol=1e-5, rtol=1e-5)
    synced.eval()
    plain.eval()
    torch.testing.assert_close(synced(y), plain(x), atol=1e-5, rtol=1e-5)


def test_a_resnet_has_every_batchnorm_replaced_and_keeps_its_parameters():
    model = ResNet("resnet18", num_classes=10, width=8)
    before = dict(model.named_parameters())
    keys = list(model.state_dict())
    convert(model, lambda layer, name: SyncBatchNorm(layer, one_rank, name))
    layers = [m for m in model.modules() if isinstance(m, torch.nn.modules.batchnorm._BatchNorm)]
    assert len(layers) == 20 and all(isinstance(m, SyncBatchNorm) for m in layers)
    assert {"bn1", "layer1.0.bn1", "layer2.0.downsample.1"} <= {layer.collective for layer in layers}
    assert dict(model.named_parameters()).keys() == before.keys()
    assert all(p is before[name] for name, p in model.named_parameters())
    assert list(model.state_dict()) == keys, "a torchvision state_dict still loads"

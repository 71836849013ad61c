"""bertforge.dropout: masks from a counter-based hash (kernels/dropout.h, and the same bits from torch's operators),
dropout's values and gradients, the seed and the generator state deciding the masks, and the model's dropout never
falling back to torch's slow CPU masks."""

from __future__ import annotations

import pytest
import torch
from support import binomial_bound

from bertforge import dropout as fast
from bertforge import kernels
from bertforge.config import BertConfig
from bertforge.models import BertForSequenceClassification

CASES = [(0, 0.1, 1), (1, 0.5, 2), (17, 0.1, -1), (1000, 0.1, 12345), (65_536 * 3 + 5, 0.25, 2**63 - 1),
         (4099, 0.9, -(2**63))]


def _lowbias32(x: int) -> int:
    """The hash as its author wrote it, in plain Python integers: the spec both implementations must meet."""
    x ^= x >> 16
    x = (x * 0x7FEB352D) & 0xFFFFFFFF
    x ^= x >> 15
    x = (x * 0x846CA68B) & 0xFFFFFFFF
    return x ^ (x >> 16)


def _keep_by_the_spec(n: int, p: float, key: int) -> list[bool]:
    k = key & 0xFFFFFFFFFFFFFFFF
    k0, k1, t = k & 0xFFFFFFFF, k >> 32, round(p * 2**32)
    return [_lowbias32((_lowbias32(i ^ k0) + k1) & 0xFFFFFFFF) >= t for i in range(n)]


@pytest.mark.parametrize(("n", "p", "key"), CASES[:4])
def test_the_torch_masks_are_the_hash_written_out(n, p, key):
    assert fast.keep_mask_reference(n, p, key).tolist() == _keep_by_the_spec(n, p, key)


@pytest.mark.parametrize(("n", "p", "key"), CASES)
def test_the_kernel_gives_the_torch_masks_bit_for_bit(int8_kernels, n, p, key):
    got = torch.ops.bertforge.keep_mask(n, p, key)
    assert got.dtype == torch.bool and got.shape == (n,)
    assert torch.equal(got, fast.keep_mask_reference(n, p, key))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("shape", "p", "key"), [((7,), 0.1, 3), ((32, 4, 40, 40), 0.5, -(2**63)),
                                                 ((3, 70_000), 0.9, 2**63 - 1)])
def test_the_kernel_applies_the_mask_as_torchs_operators_do(int8_kernels, dtype, shape, p, key):
    """x * keep * 1 / (1 - p) in one pass with the mask computed on the way: torch's values to the bit, -0 and
    infinities included (x times a dropped 0 is -0 or NaN there too), on a non-contiguous input as on its copy."""
    x = torch.randn(shape).to(dtype)
    x.view(-1)[:6] = torch.tensor([float("inf"), float("-inf"), float("nan"), -0.0, 0.0, -1.0])
    expected = x * fast.keep_mask_reference(x.numel(), p, key).view(shape) * (1.0 / (1.0 - p))
    for given in (x, x.transpose(0, -1).contiguous().transpose(0, -1)):  # the same values, other strides
        got = torch.ops.bertforge.apply_keep_mask(given, p, key)
        nan = got.isnan()
        assert got.dtype == dtype and got.shape == shape and torch.equal(nan, expected.isnan())
        bits = torch.int32 if dtype == torch.float32 else torch.int16
        assert torch.equal(got[~nan].view(bits), expected[~nan].view(bits))


def test_without_the_kernels_dropout_draws_the_same_masks(monkeypatch):
    x = torch.randn(64, 33)
    torch.manual_seed(3)
    with_kernels = fast.dropout(x, 0.1)
    monkeypatch.setattr(kernels, "available", lambda: False)
    torch.manual_seed(3)
    assert torch.equal(fast.dropout(x, 0.1), with_kernels)


@pytest.mark.parametrize("p", [0.1, 0.5, 0.9])
def test_masks_drop_p_of_the_elements_independently(p):
    n = 200_000
    keys = [11, 12]
    a, b = (~fast.keep_mask(n, p, k) for k in keys)  # dropped
    for dropped in (a, b):
        assert abs(dropped.float().mean().item() - p) < binomial_bound(n, p)
        neighbours = (dropped[:-1] & dropped[1:]).float().mean().item()  # both of two adjacent elements
        assert abs(neighbours - p * p) < binomial_bound(n, p * p)
    both = (a & b).float().mean().item()  # the same element under two keys
    assert abs(both - p * p) < binomial_bound(n, p * p)


def test_dropout_scales_what_it_keeps_and_its_gradient_goes_through_the_same_mask():
    x = torch.randn(40, 50, requires_grad=True)
    torch.manual_seed(0)
    y = fast.dropout(x, 0.2)
    kept = y != 0
    assert 0.7 < kept.float().mean().item() < 0.9
    torch.testing.assert_close(y[kept], x[kept] / 0.8)
    assert y.grad_fn.saved_tensors == ()  # the backward recomputes the mask from the call's key: none kept
    weights = torch.randn(40, 50)
    (y * weights).sum().backward()
    torch.testing.assert_close(x.grad, weights * kept / 0.8)


def test_the_generator_decides_the_masks():
    x = torch.randn(1000)
    torch.manual_seed(5)
    first, second = fast.dropout(x, 0.5), fast.dropout(x, 0.5)
    torch.manual_seed(5)
    assert torch.equal(fast.dropout(x, 0.5), first)
    assert not torch.equal(first, second)  # each call draws a new key


def test_off_in_eval_at_zero_and_torchs_own_elsewhere():
    x = torch.randn(8, 8)
    assert fast.dropout(x, 0.5, training=False) is x and fast.dropout(x, 0.0) is x
    assert torch.equal(fast.dropout(x, 1.0), torch.zeros_like(x))
    module = fast.Dropout(0.3).eval()
    assert module(x) is x and not list(module.parameters())


def test_a_models_training_step_never_draws_torchs_cpu_masks():
    """Every dropout of the model (embeddings, attention probabilities, residual branches, classifier) takes the
    cheap masks, SDPA's included: torch's would cost 12% of a fine-tuning step. Every ATen operator the step runs
    is seen (a dispatch mode sees those that composite operators such as SDPA's math path call inside)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Seen(TorchDispatchMode):
        names: set[str] = set()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.names.add(func.__name__)
            return func(*args, **(kwargs or {}))

    config = BertConfig(vocab_size=50, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                        intermediate_size=64, max_position_embeddings=16, num_labels=2)
    model = BertForSequenceClassification(config).train()
    assert sum(isinstance(m, fast.Dropout) for m in model.modules()) == 1 + 2 + 1  # embeddings, layers, head
    ids = torch.randint(1, 50, (4, 12))
    mask = torch.ones_like(ids)
    mask[0, 8:] = 0  # padding: the attention takes a mask
    with Seen() as seen:
        out = model(ids, attention_mask=mask, labels=torch.tensor([0, 1, 0, 1]))
        out.loss.backward()
    assert torch.isfinite(out.loss)
    drawn = {n for n in seen.names if "bernoulli" in n or "dropout" in n}
    assert not drawn, f"torch's CPU dropout ran: {drawn}"
    assert any("mm" in n for n in seen.names)  # the mode did see the step

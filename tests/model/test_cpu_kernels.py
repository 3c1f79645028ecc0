"""The CPU convolutions of ``rtvideo.workers.pipelines.cpu_kernels``: rows run grouped
only where that gives the batch's very bits, each shape decided once."""

from __future__ import annotations

import pytest
import torch
from diffusers.models.autoencoders.autoencoder_kl_wan import WanCausalConv3d

from rtvideo.workers.pipelines import cpu_kernels
from rtvideo.workers.pipelines.cpu_kernels import NARROW, OneDnnCausalConv3d, OneDnnConv2d, use_fast_cpu_kernels

pytestmark = pytest.mark.skipif(not cpu_kernels._ONEDNN, reason="this torch has no oneDNN convolution")


def causal(channels_in: int, channels_out: int, seed: int = 0) -> OneDnnCausalConv3d:
    torch.manual_seed(seed)
    holder = torch.nn.Sequential(WanCausalConv3d(channels_in, channels_out, 3, padding=1))
    assert use_fast_cpu_kernels(holder) == 1
    return holder[0]


def each_alone(conv, x: torch.Tensor, *rest: torch.Tensor) -> torch.Tensor:
    return torch.cat([conv(row, *(r[i : i + 1] for r in rest)) for i, row in enumerate(x.split(1))])


@torch.no_grad()
def test_a_narrow_convolution_over_rows_equals_each_row_alone_whatever_it_decided():
    conv = causal(4, 4)
    x, cache = torch.randn(4, 4, 4, 16, 16), torch.randn(4, 4, 2, 16, 16)
    for _ in range(3):  # the decision, then the decided form twice
        assert torch.equal(conv(x, cache), each_alone(conv, x, cache))
    assert list(conv._row_grouping.grouped) == [((4, 4, 6, 16, 16), (0, 1, 1))]


@torch.no_grad()
def test_rows_run_grouped_only_where_the_grouped_kernel_gives_the_same_bits(monkeypatch):
    conv = causal(4, 4)
    real = torch.mkldnn_convolution
    grouped_calls = []

    def off_by_a_little(x, weight, bias, padding, stride, dilation, groups):
        y = real(x, weight, bias, padding, stride, dilation, groups)
        if groups > 1:
            grouped_calls.append(groups)
            return y + 1e-3
        return y

    monkeypatch.setattr(torch, "mkldnn_convolution", off_by_a_little)
    x = torch.randn(3, 4, 1, 8, 8)
    expected = torch.cat([conv(row) for row in x.split(1)])
    for _ in range(2):
        assert torch.equal(conv(x), expected)
    assert grouped_calls == [3]  # tried once, found to differ, never used
    assert conv._row_grouping.grouped == {((3, 4, 3, 8, 8), (0, 1, 1)): False}


@torch.no_grad()
def test_a_shape_is_decided_once_and_its_grouped_form_used_after(monkeypatch):
    conv = causal(4, 4)
    x = torch.randn(2, 4, 1, 8, 8)
    conv(x)
    key = ((2, 4, 3, 8, 8), (0, 1, 1))
    conv._row_grouping.grouped[key] = True  # as a decision for the grouped form leaves it
    real = torch.mkldnn_convolution
    groups_seen = []
    monkeypatch.setattr(torch, "mkldnn_convolution", lambda *args: groups_seen.append(args[-1]) or real(*args))
    assert torch.allclose(conv(x), torch.cat([conv(row) for row in x.split(1)]), atol=1e-6)
    assert groups_seen == [2, 1, 1]  # the two rows as one grouped call; then each alone


@torch.no_grad()
def test_grouped_weights_follow_the_modules_weights():
    conv = causal(4, 4)
    x = torch.randn(2, 4, 1, 8, 8)
    conv(x)
    conv._row_grouping.grouped[((2, 4, 3, 8, 8), (0, 1, 1))] = True
    before = conv(x)
    conv.weight.mul_(2.0)  # in place, as load_state_dict writes
    conv.bias.add_(1.0)
    after = conv(x)
    assert not torch.allclose(after, before)
    assert torch.allclose(after, torch.cat([conv(row) for row in x.split(1)]), atol=1e-5)


@torch.no_grad()
def test_wide_convolutions_run_as_one_batch():
    conv = causal(NARROW, 4)
    x = torch.randn(2, NARROW, 1, 8, 8)
    assert torch.equal(conv(x), torch.cat([conv(row) for row in x.split(1)]))
    assert "_row_grouping" not in conv.__dict__


@torch.no_grad()
def test_a_narrow_2d_convolution_over_frames_equals_each_frame_alone():
    torch.manual_seed(1)
    holder = torch.nn.Sequential(torch.nn.Conv2d(8, 4, 3, padding=1))
    assert use_fast_cpu_kernels(holder) == 1 and type(holder[0]) is OneDnnConv2d
    conv = holder[0]
    x = torch.randn(8, 8, 32, 32)
    for _ in range(2):
        assert torch.equal(conv(x), torch.cat([conv(row) for row in x.split(1)]))
    reference = torch.nn.functional.conv2d(x, conv.weight, conv.bias, padding=1)
    assert (conv(x) - reference).abs().max().item() <= 1e-5 * reference.abs().max().item()


@torch.no_grad()
def test_other_dtypes_take_diffusers_own_path():
    conv = causal(4, 4).bfloat16()
    x = torch.randn(2, 4, 1, 8, 8).bfloat16()
    torch.manual_seed(0)
    reference = WanCausalConv3d(4, 4, 3, padding=1).bfloat16()
    assert torch.equal(conv(x), reference(x))
    assert "_row_grouping" not in conv.__dict__

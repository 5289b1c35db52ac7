"""The parts around the recurrent cores that Mamba-2 and Gated DeltaNet share: the short causal
convolution (with the decode state of either width) and the gated RMSNorm (either order, groups)."""

import pytest
import torch
import torch.nn.functional as F

from zoo.components.mixers._recurrent import GatedRMSNorm, ShortConv


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("width", [3, 4])  # kernel - 1 (Qwen3-Next's cache), kernel (Mamba-2's)
def test_the_short_convolution_is_a_causal_depthwise_conv1d_and_continues_from_its_state(bias, width):
    torch.manual_seed(0)
    conv = ShortConv(6, 4, bias=bias, state_width=width)
    x = torch.randn(2, 11, 6)
    want = F.silu(F.conv1d(x.transpose(1, 2), conv.weight, conv.bias, padding=3, groups=6)[..., :11]).transpose(1, 2)
    with torch.no_grad():
        torch.testing.assert_close(conv(x), want, atol=1e-6, rtol=0)
        state = torch.zeros(2, 6, width)
        pieces = [conv(x[:, a:b], state) for a, b in ((0, 2), (2, 3), (3, 9), (9, 10), (10, 11))]
    torch.testing.assert_close(torch.cat(pieces, 1), want, atol=1e-6, rtol=0)
    torch.testing.assert_close(state, x[:, -width:].transpose(1, 2))  # the last `width` inputs


def test_the_short_convolution_without_activation_is_the_plain_convolution_and_silu_stays_the_default():
    torch.manual_seed(0)
    plain = ShortConv(6, 4, bias=True, state_width=3, activation=None)
    silu = ShortConv(6, 4, bias=True, state_width=3)
    silu.load_state_dict(plain.state_dict())
    x = torch.randn(2, 9, 6)
    conv = F.conv1d(x.transpose(1, 2), plain.weight, plain.bias, padding=3, groups=6)[..., :9].transpose(1, 2)
    with torch.no_grad():
        torch.testing.assert_close(plain(x), conv, atol=1e-6, rtol=0)
        torch.testing.assert_close(silu(x), F.silu(conv), atol=1e-6, rtol=0)
        assert (plain(x) < 0).any()  # not clipped by any activation
        state = torch.zeros(2, 6, 3)
        pieces = [plain(x[:, a:b], state) for a, b in ((0, 4), (4, 5), (5, 9))]
    torch.testing.assert_close(torch.cat(pieces, 1), conv, atol=1e-6, rtol=0)
    with pytest.raises(ValueError, match="activation must be one of"):
        ShortConv(6, 4, bias=False, state_width=3, activation="gelu")


def test_the_short_convolution_refuses_another_state_width():
    with pytest.raises(ValueError, match="state_width must be kernel - 1 or kernel"):
        ShortConv(6, 4, bias=False, state_width=2)


@pytest.mark.parametrize("groups", [1, 2])
def test_the_gated_rmsnorm_in_either_order(groups):
    torch.manual_seed(0)
    x, z = torch.randn(3, 5, 8), torch.randn(3, 5, 8)
    w = torch.randn(8)

    def rms(h):
        h = h.unflatten(-1, (groups, -1))
        return (h / (h.pow(2).mean(-1, keepdim=True) + 1e-6).sqrt()).flatten(-2)

    for before, want in ((True, w * rms(x) * F.silu(z)), (False, w * rms(x * F.silu(z)))):
        norm = GatedRMSNorm(8, 1e-6, groups=groups, norm_before_gate=before)
        with torch.no_grad():
            norm.weight.copy_(w)
            torch.testing.assert_close(norm(x, z), want, atol=1e-6, rtol=1e-6)

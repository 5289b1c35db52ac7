"""Attention masks at long context: FlexAttention block masks built from block bounds (never a
(Tq, Tk) mask), cached per shape, and built once per forward where padding makes them depend on
the data; the same once-per-forward rule for the dense masks of the reference paths."""

import pytest
import torch
from torch.nn.attention.flex_attention import create_block_mask, flex_attention
from torch.utils._python_dispatch import TorchDispatchMode

import zoo
from zoo.core import kernels
from zoo.components.mixers import _masks as masks
from zoo.components.mixers._masks import causal_mask
from zoo.components.kernels import attention as flex

pytestmark = pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")


def reference_attention(q, k, v, allowed):
    B, H, T, D = q.shape
    G = H // k.shape[1]
    s = (q.view(B, k.shape[1], G, T, D) @ k[:, :, None].transpose(-1, -2)).view(B, H, T, -1) * D ** -0.5
    p = torch.softmax(s.masked_fill(~allowed, float("-inf")), -1)
    return (p.view(B, k.shape[1], G, T, -1) @ v[:, :, None]).view(B, H, T, D)


@pytest.mark.parametrize("T,window", [(300, None), (300, 100), (130, 3), (257, 128), (512, 256)])
def test_block_mask_is_the_one_create_block_mask_builds(T, window):
    idx = torch.arange(T)
    ours = flex.block_mask(idx, idx, window)
    theirs = create_block_mask(lambda b, h, q, k: flex._sees(q, k, window), None, None, T, T, device="cpu")
    for name in ("kv_num_blocks", "kv_indices", "full_kv_num_blocks"):
        a, b = getattr(ours, name), getattr(theirs, name)
        if name == "kv_indices":  # only the first kv_num_blocks entries of a row are read
            n = int(ours.kv_num_blocks.max())
            a, b = a[..., :n], b[..., :n]
        assert torch.equal(a, b), name
    assert torch.equal(ours.to_dense(), theirs.to_dense())


@pytest.mark.parametrize("T,window", [(300, None), (300, 100), (130, 3)])
def test_block_masks_with_padding_and_unordered_cached_keys_match_the_reference(T, window):
    torch.manual_seed(0)
    idx = torch.arange(T)
    key_mask = torch.ones(2, T, dtype=torch.bool)
    key_mask[0, :150] = False  # whole blocks of padding, and padding queries that see nothing
    key_mask[1, :3] = False
    q, k, v = torch.randn(2, 4, T, 8), torch.randn(2, 2, T, 8), torch.randn(2, 2, T, 8)
    want = reference_attention(q, k, v, causal_mask(idx, idx, window, key_mask))
    got = flex_attention(q, k, v, block_mask=flex.build_block_mask(idx, idx, window, key_mask), enable_gqa=True)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    perm = torch.randperm(T)  # a ring cache returns its keys out of order
    mask = flex.build_block_mask(idx, idx[perm], window, key_mask[:, perm])
    got = flex_attention(q, k[:, :, perm], v[:, :, perm], block_mask=mask, enable_gqa=True)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


class LargestTensor(TorchDispatchMode):
    """Records the largest number of elements of any tensor an operation produces."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel())
        return out


@pytest.mark.parametrize("padding", [False, True])
def test_building_a_block_mask_holds_blocks_not_token_pairs(padding):
    T, B = 16384, 2  # T x T would be 268M elements
    idx = torch.arange(T)
    key_mask = torch.ones(B, T, dtype=torch.bool)
    key_mask[0, :1000] = False
    with LargestTensor() as seen:
        mask = flex.build_block_mask(idx, idx, 4096, key_mask if padding else None)
    blocks = (T // flex.BLOCK) ** 2  # 16384 block pairs
    assert seen.largest <= 4 * B * max(blocks, T), seen.largest  # vs B * T * T = 537M
    stored = sum(t.numel() * t.element_size() for t in mask.as_tuple() if isinstance(t, torch.Tensor))
    assert stored <= 8 * 4 * B * blocks  # a few int32 tables of blocks: under 1 MiB here


def test_masks_are_not_rebuilt_when_the_shape_repeats_and_once_per_forward_with_padding():
    model = zoo.build("gemma2-2b", n_layers=4, d_model=32, vocab_size=150, seed=0,
                      overrides={"layers.*.mixer.head_dim": 16, "layers.*.ffn.d_ff": 48,
                                 "layers.local.mixer.window": 3}).eval()
    ids = torch.randint(0, 150, (2, 11))
    pad = torch.ones(2, 11, dtype=torch.long)
    pad[0, :3] = 0
    flex._by_shape.clear()
    with torch.no_grad(), kernels.using("attention:flex"):
        before = flex.builds
        model(ids)
        assert flex.builds - before == 2  # one per window (local 3, global none), not per layer
        model(ids)
        model(ids[:1])  # the batch size does not enter a mask without padding
        assert flex.builds - before == 2
        model(ids[:, :7])
        assert flex.builds - before == 4  # a new length: a new pair
        model(ids, attention_mask=pad)
        assert flex.builds - before == 6  # padding: one per window in this forward, for its 4 layers
        model(ids, attention_mask=pad)
        assert flex.builds - before == 8  # and again for the next forward: it depends on the data
    assert not masks._memo  # nothing outlives its forward


def test_dense_masks_of_the_reference_paths_are_built_once_per_forward(monkeypatch):
    from zoo.components.mixers import _masks

    built = []
    real = _masks.causal_mask
    monkeypatch.setattr(_masks, "causal_mask", lambda *a: built.append(a[2]) or real(*a))  # the window; not the tensors
    model = zoo.build("mistral-7b", n_layers=4, d_model=32, vocab_size=150, seed=0,
                      overrides={"layers.*.mixer.window": 3, "layers.*.mixer.head_dim": 8,
                                 "layers.*.ffn.d_ff": 48})
    ids = torch.randint(0, 150, (2, 9))
    pad = torch.ones(2, 9, dtype=torch.long)
    pad[0, :2] = 0
    for setting in ("attention:sdpa", "attention:eager"):
        built.clear()
        with kernels.using(setting):
            model(ids, attention_mask=pad).sum().backward()
        assert len(built) == 1, setting
    assert not masks._memo

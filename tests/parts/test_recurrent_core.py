"""The shared core of scalar-decay recurrences (zoo/components/mixers/_recurrent.py): the chunked form equals the
one-step recurrence on random inputs of odd lengths, with and without a carried state."""

import pytest
import torch

from zoo.components.mixers import _recurrent as recurrent

pytestmark = pytest.mark.usefixtures("one_thread")


def scan(q, k, v, a, state=None):
    ys = []
    for t in range(q.shape[2]):
        y, state = recurrent.step(q[:, :, t], k[:, :, t], v[:, :, t], None if a is None else a[:, :, t], state)
        ys.append(y)
    return torch.stack(ys, 2), state


def inputs(T, *, B=2, H=3, Dk=5, Dv=7, decay="data", seed=0):
    g = torch.Generator().manual_seed(seed)
    q, k = (torch.randn(B, H, T, Dk, generator=g) for _ in range(2))
    v = torch.randn(B, H, T, Dv, generator=g)
    a = {"none": None, "fixed": -torch.rand(H, generator=g)[None, :, None].expand(B, H, T).contiguous(),
         "data": -3 * torch.rand(B, H, T, generator=g)}[decay]
    return q, k, v, a


@pytest.mark.parametrize("decay", ["none", "fixed", "data"])
@pytest.mark.parametrize("T,chunk", [(1, 4), (7, 4), (13, 5), (31, 64), (33, 8)])
def test_chunked_form_equals_the_recurrence(T, chunk, decay):
    q, k, v, a = inputs(T, decay=decay)
    s0 = torch.randn(2, 3, 5, 7)
    y, s = recurrent.chunked(q, k, v, a, s0, chunk=chunk)
    y_ref, s_ref = scan(q, k, v, a, s0)
    scale = y_ref.abs().max().clamp_min(1)  # plain linear attention grows with T; compare relative to it
    assert (y - y_ref).abs().max() / scale <= 1e-5
    assert (s - s_ref).abs().max() / s_ref.abs().max().clamp_min(1) <= 1e-5


def test_state_passes_between_calls_as_within_one():
    q, k, v, a = inputs(23)
    y, s = recurrent.chunked(q, k, v, a, chunk=4)
    y1, s1 = recurrent.chunked(q[:, :, :9], k[:, :, :9], v[:, :, :9], a[:, :, :9], chunk=4)
    y2, s2 = recurrent.chunked(q[:, :, 9:], k[:, :, 9:], v[:, :, 9:], a[:, :, 9:], s1, chunk=16)
    torch.testing.assert_close(torch.cat([y1, y2], 2), y, rtol=0, atol=1e-5)
    torch.testing.assert_close(s2, s, rtol=0, atol=1e-5)


def test_strong_decay_over_a_long_sequence_stays_finite():
    q, k, v, _ = inputs(300, B=1, H=2)
    a = torch.full((1, 2, 300), -50.0, requires_grad=True)  # cumulative sums of -15000: none may be exponentiated
    y, s = recurrent.chunked(q, k, v, a, chunk=64)
    assert torch.isfinite(y).all() and torch.isfinite(s).all()
    assert torch.isfinite(torch.autograd.grad(y.sum(), a)[0]).all()
    # each step forgets the past: y_t = (q_t . k_t) v_t
    torch.testing.assert_close(y, (q * k).sum(-1, keepdim=True) * v, rtol=1e-5, atol=1e-5)


def test_gradients_are_finite_and_match_the_recurrence():
    q, k, v, a = inputs(11, B=1, H=2, Dk=3, Dv=4)
    a = a.clone().requires_grad_()
    for t in (q, k, v):
        t.requires_grad_()
    y, s = recurrent.chunked(q, k, v, a, chunk=4)
    g = torch.autograd.grad((y.square().sum() + s.sum()), (q, k, v, a))
    y_ref, s_ref = scan(q, k, v, a)
    g_ref = torch.autograd.grad((y_ref.square().sum() + s_ref.sum()), (q, k, v, a))
    for x, r in zip(g, g_ref):
        torch.testing.assert_close(x, r, rtol=1e-5, atol=1e-5)


def test_bad_input_is_named():
    q, k, v, a = inputs(5)
    with pytest.raises(ValueError, match="chunk"):
        recurrent.chunked(q, k, v, a, chunk=0)
    with pytest.raises(ValueError, match="log_decay"):
        recurrent.chunked(q, k, v, a[:, :1])
    with pytest.raises(ValueError, match="state"):
        recurrent.chunked(q, k, v, a, torch.zeros(2, 3, 7, 5))


def scan64(q, k, v, a, state):
    """The recurrence itself in float64, with a decay of exp(a) (0 where a is -inf)."""
    S, ys = state.double(), []
    for t in range(q.shape[2]):
        S = torch.exp(a[:, :, t].double())[..., None, None] * S + k[:, :, t, :, None].double() * v[:, :, t, None, :].double()
        ys.append((q[:, :, t, None, :].double() @ S).squeeze(-2))
    return torch.stack(ys, 2), S


@pytest.mark.parametrize("T,chunk", [(13, 4), (33, 8), (9, 64)])
def test_a_restart_forgets_the_state_without_nan(T, chunk):
    """A log-decay of -inf (decay 0: a document boundary) must give what the step-by-step form gives."""
    q, k, v, a = inputs(T)
    a = a.clone()
    a[0, :, 0] = float("-inf")       # a restart on the very first token (the carried state is dropped)
    a[0, 1, min(chunk, T) - 1] = float("-inf")  # at a chunk's last step
    a[1, :, T // 2] = float("-inf")   # inside a chunk
    s0 = torch.randn(2, 3, 5, 7)
    y, s = recurrent.chunked(q, k, v, a, s0, chunk=chunk)
    y64, s64 = scan64(q, k, v, a, s0)
    y_step, s_step = scan(q, k, v, a, s0)
    assert torch.isfinite(y).all() and torch.isfinite(s).all()
    for got, ref in ((y, y64), (s, s64), (y_step, y64)):
        # float32 against float64: a few float32 ulps of the largest magnitude
        assert (got.double() - ref).abs().max() <= 1e-5 * ref.abs().max()
    # after a restart the output is that of a fresh start from that token
    t = T // 2
    y_fresh, _ = scan64(q[1:, :, t:], k[1:, :, t:], v[1:, :, t:], a[1:, :, t:], torch.zeros(1, 3, 5, 7))
    assert (y[1:, :, t:].double() - y_fresh).abs().max() <= 1e-5 * y_fresh.abs().max()
    # a restart also stops gradients reaching the decays before it, without NaN
    a_req = a.clone().requires_grad_(True)
    grad = torch.autograd.grad(recurrent.chunked(q, k, v, a_req, s0, chunk=chunk)[0].sum(), a_req)[0]
    assert torch.isfinite(grad).all()

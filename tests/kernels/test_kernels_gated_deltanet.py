"""The Triton kernel of the chunked gated delta rule against the PyTorch chunked form, on the CPU
under Triton's interpreter, in fp32: outputs, final state and every gradient (q, k, v, g, beta,
initial state), on lengths that are not multiples of the chunk or shorter than one, head widths that
are not powers of two, grouped key heads, value columns split into blocks, and strong decays; and the
Gated DeltaNet mixer choosing it through zoo.kernels."""

import os

os.environ["TRITON_INTERPRET"] = "1"  # before any kernel is defined: they then run on CPU tensors

import pytest
import torch

pytest.importorskip("triton")

import zoo.testing as zt  # noqa: E402
from zoo.core import kernels  # noqa: E402
from zoo.components.mixers import gated_deltanet as gdn  # noqa: E402
from zoo.components.kernels import gated_deltanet as fast  # noqa: E402
from kernel_refs import assert_compiles_as_eager, bf16_error_bound, rel  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")


def inputs(B, Hk, H, T, Dk, Dv, with_state, decay, seed=0):
    """q scaled as the mixer scales it, k L2-normalised, beta in (0, 1), g in [-decay, 0]."""
    g = torch.Generator().manual_seed(seed)
    q = gdn.l2norm(torch.randn(B, Hk, T, Dk, generator=g)) * Dk ** -0.5
    k = gdn.l2norm(torch.randn(B, Hk, T, Dk, generator=g))
    v = torch.randn(B, H, T, Dv, generator=g)
    log_decay = -decay * torch.rand(B, H, T, generator=g)
    beta = torch.rand(B, H, T, generator=g)
    s0 = torch.randn(B, H, Dk, Dv, generator=g) if with_state else None
    return [t.requires_grad_() if t is not None else None for t in (q, k, v, log_decay, beta, s0)]


def run(fn, tensors, seed=1):
    """Outputs, final state, and the gradients of a random projection of both."""
    y, s = fn(*tensors)
    g = torch.Generator().manual_seed(seed)
    loss = (y * torch.randn(y.shape, generator=g)).sum() + (s * torch.randn(s.shape, generator=g)).sum()
    return [y, s, *torch.autograd.grad(loss, [t for t in tensors if t is not None])]


@pytest.mark.parametrize("B,Hk,H,T,Dk,Dv,with_state,decay,block_v", [
    (2, 2, 4, 37, 5, 7, True, 2.0, None),    # odd length, 3 chunks; grouped key heads; widths 5 and 7
    (1, 2, 4, 37, 5, 7, False, 2.0, None),   # the same from a zero state
    (1, 1, 2, 5, 8, 8, False, 1.0, None),    # shorter than a chunk
    (1, 2, 4, 40, 12, 32, True, 30.0, 16),   # strong decays; two blocks of value columns
    (1, 1, 3, 20, 6, 10, True, 1e3, None),   # decays that underflow to 0 within a step
])
def test_kernel_matches_the_chunked_form_forward_and_backward(B, Hk, H, T, Dk, Dv, with_state, decay, block_v):
    made = inputs(B, Hk, H, T, Dk, Dv, with_state, decay)
    clone = lambda: [t.detach().clone().requires_grad_() if t is not None else None for t in made]  # noqa: E731
    got = run(lambda *t: fast.chunk_gated_delta_rule(*t, chunk_size=16, block_v=block_v), clone())
    want = run(lambda *t: gdn.chunk_gated_delta_rule(*t, chunk_size=16), clone())
    names = ["outputs", "final state", "dq", "dk", "dv", "dg", "dbeta"] + (["dstate"] if with_state else [])
    assert len(got) == len(want) == len(names)
    for name, a, b in zip(names, got, want):
        assert a.shape == b.shape, name
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5 * max(1.0, float(b.detach().abs().max())),
                                   msg=lambda m: f"{name}: {m}")  # noqa: B023


def test_a_block_of_value_columns_must_divide_them():
    q, k, v, g, beta, _ = inputs(1, 1, 1, 4, 4, 24, False, 1.0)
    with pytest.raises(ValueError, match="block_v 16 must divide the value width 24"):
        fast.chunk_gated_delta_rule(q, k, v, g, beta, block_v=16)


def tiny():
    return zt.tiny_model(zt.hybrid_spec("gated_deltanet", {"n_heads": 4, "n_key_heads": 2, "key_dim": 8,
                                                           "value_dim": 6, "chunk_size": 4}))


def test_the_mixer_chooses_the_kernel_only_when_forced_and_computes_the_same(monkeypatch):
    model = tiny()
    mixer = model.layers[0].mixer
    x = torch.randn(2, 9, 8)
    assert kernels.decide(mixer, "cpu", torch.float32).backend is None  # never chosen on the CPU by itself
    calls = []
    real = fast._inter_chunk_op
    monkeypatch.setattr(fast, "_inter_chunk_op", lambda *a: calls.append(1) or real(*a))
    ids = torch.randint(0, model.spec.vocab_size, (2, 11))
    with kernels.using("gated_delta:triton"):
        assert kernels.decide(mixer, "cpu", torch.float32, x).backend == "triton"
        got = model(ids)
        got.square().mean().backward()
    assert calls, "the forced kernel did not run"
    got_grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    with kernels.using("off"):
        want = model(ids)
        want.square().mean().backward()
    assert len(calls) == 1  # the reference path did not call it
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    for n, p in model.named_parameters():
        if p.grad is not None:
            torch.testing.assert_close(got_grads[n], p.grad, rtol=1e-5, atol=1e-6, msg=lambda m: f"{n}: {m}")  # noqa: B023


def test_the_kernel_in_the_mixer_with_left_padding_and_a_decode_state():
    """A left-padded batch, and a prefill then several tokens onto the state (the state enters the
    kernel), equal the reference path's full forward; single decode steps stay on PyTorch."""
    model = tiny()
    ids = torch.randint(0, model.spec.vocab_size, (2, 10))
    padded = torch.cat([torch.zeros(2, 3, dtype=ids.dtype), ids], 1)
    mask = torch.cat([torch.tensor([[0, 0, 0], [1, 1, 1]]), torch.ones(2, 10, dtype=torch.long)], 1)
    with torch.no_grad():
        with kernels.using("off"):
            want_padded = model(padded, attention_mask=mask)
            want = model(ids)
        with kernels.using("gated_delta:triton"):
            got_padded = model(padded, attention_mask=mask)
            state = model.new_state(2, None)
            steps = [model(ids[:, :5], state=state), model(ids[:, 5:9], state=state), model(ids[:, 9:], state=state)]
    torch.testing.assert_close(got_padded, want_padded, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got_padded[:1, 3:], want[:1], rtol=1e-5, atol=1e-4)  # padding invisible
    torch.testing.assert_close(torch.cat(steps, 1), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("with_state", [True, False])
def test_the_backward_in_segments_of_chunks_matches(with_state):
    """The backward keeps the states before each segment of chunks and rebuilds each segment's states
    from them: 5 chunks in segments of 2 (the last one shorter) give the chunked form's gradients."""
    made = inputs(1, 1, 2, 75, 8, 16, with_state, 2.0)
    clone = lambda: [t.detach().clone().requires_grad_() if t is not None else None for t in made]  # noqa: E731
    got = run(lambda *t: fast.chunk_gated_delta_rule(*t, chunk_size=16, segment=2), clone())
    want = run(lambda *t: gdn.chunk_gated_delta_rule(*t, chunk_size=16), clone())
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5 * max(1.0, float(b.detach().abs().max())))


def test_segments_bound_the_states_the_backward_holds():
    """At Qwen3-Next's 262,144 tokens in chunks of 32 the backward holds 91 + 91 states per value
    head instead of 8,192 (17 GB per layer at 32 heads of 128 x 128 in fp32: now 0.4 GB)."""
    N = 262_144 // 32
    M = fast._segment(N)
    assert (M, -(-N // M)) == (91, 91)
    assert fast._segment(64) == 64  # short sequences: one segment, as before


def test_batch_times_heads_is_on_the_grid_axis_without_the_65535_limit(monkeypatch):
    """B * H (and the UT transform's B * H * chunks) go on the grid's first axis (up to 2^31 - 1);
    the second axis holds only the value blocks. Launches are recorded, not run."""
    grids = []
    monkeypatch.setattr(fast, "launch", lambda kernel, grid, configs, *a, **kw: grids.append((kernel.__name__, grid)))
    q, k, v, g, beta, s0 = inputs(70_000, 1, 1, 1, 1, 1, True, 1.0)
    y, s = fast.chunk_gated_delta_rule(q, k, v, g, beta, s0)
    torch.autograd.backward([y, s], [torch.ones_like(y), torch.ones_like(s)])
    assert {name for name, _ in grids} == {"_fwd", "_bwd", "_ut_fwd", "_ut_bwd"}
    for name, grid in grids:
        assert grid[0] == 70_000 and all(n <= 65_535 for n in grid[1:]), (name, grid)


def test_bf16_inputs_are_as_accurate_as_the_reference_in_bf16():
    """bf16 inputs take the TF32 products, the triangular solve of the UT transform included (the
    interpreter computes them as IEEE fp32: it ignores ``input_precision``). Outputs and gradients
    are within twice the error of the chunked form's result stored in bf16, as the interpreter
    stores it (toward zero), both against the recurrent form in float64 on the same bf16-valued
    inputs; the fp32 state and its gradient within the fp32 tests' 1e-5."""
    made = [t.detach() for t in inputs(1, 2, 2, 50, 16, 16, True, 2.0)]
    q, k, v = (t.bfloat16().float() for t in made[:3])
    g_, beta, s0 = made[3:]
    gen = torch.Generator().manual_seed(3)
    dy = torch.randn(1, 2, 50, 16, generator=gen).bfloat16().float()
    ds = torch.randn(1, 2, 16, 16, generator=gen)

    def outcome(fn, dtype, qkv_dtype=None):
        xs = [t.to(qkv_dtype or dtype).requires_grad_() for t in (q, k, v)]
        xs += [t.to(dtype).requires_grad_() for t in (g_, beta, s0)]
        y, s = fn(*xs)
        return [y, s, *torch.autograd.grad([y, s], xs, [dy.to(y.dtype), ds.to(s.dtype)])]

    want = outcome(gdn.recurrent_gated_delta_rule, torch.float64)
    got = outcome(lambda *t: fast.chunk_gated_delta_rule(*t, chunk_size=16), torch.float32, torch.bfloat16)
    core = outcome(lambda *t: gdn.chunk_gated_delta_rule(*t, chunk_size=16), torch.float32)
    assert got[0].dtype == got[2].dtype == torch.bfloat16
    for name, x, c, w in zip(["y", "state", "dq", "dk", "dv", "dg", "dbeta", "dstate"], got, core, want):
        assert rel(x, w) <= bf16_error_bound(c, w, x.dtype), (name, rel(x, w), bf16_error_bound(c, w, x.dtype))


@pytest.mark.parametrize("with_state", [True, False])
def test_the_kernel_compiles_in_one_graph_and_equals_eager(with_state):
    """Each pass (the UT transform, the sweep over chunks) is a pair of custom operators:
    torch.compile calls them as they are."""
    made = inputs(1, 2, 4, 37, 5, 7, with_state, 2.0)
    assert_compiles_as_eager(lambda *t: fast.chunk_gated_delta_rule(*t, chunk_size=16), *made)

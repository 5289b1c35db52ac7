"""The real mixed-precision setup (fp32 master weights under bf16 autocast) on every attention
path, the fused loss's precision and bounds, and kernels launched on their tensors' device."""

import os

os.environ["TRITON_INTERPRET"] = "1"  # before any kernel is defined: they then run on CPU tensors

import types  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

import zoo  # noqa: E402
from zoo.core import kernels  # noqa: E402
from zoo.components.mixers.attention import Attention  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")


def tiny(name, **over):
    base = {"layers.*.mixer.head_dim": 16, "layers.*.ffn.d_ff": 48, "layers.*.mixer.n_heads": 4,
            "layers.*.mixer.n_kv_heads": 2}
    return zoo.build(name, n_layers=2, d_model=32, vocab_size=150, seed=0, overrides={**base, **over})


def record_attention_inputs(monkeypatch, where, name):
    seen = []
    real = getattr(where, name)

    def spy(*args, **kw):
        q, k, v = [a for a in args if isinstance(a, torch.Tensor)][:3]
        seen.append((q.dtype, k.dtype, v.dtype))
        return real(*args, **kw)

    monkeypatch.setattr(where, name, spy)
    return seen


@pytest.mark.parametrize("name,path", [
    ("mistral-7b", "sdpa"), ("mistral-7b", "eager"), ("gemma2-2b", "eager"),
])
def test_a_training_step_under_bf16_autocast_over_fp32_weights(monkeypatch, name, path):
    model = tiny(name, **{"layers.*.mixer.window": 4} if name == "mistral-7b" else
                 {"layers.local.mixer.window": 4})
    ids = torch.randint(0, 150, (2, 11))
    with kernels.using("off"):
        want = model.loss(ids).loss
    seen = record_attention_inputs(monkeypatch, Attention, f"_{path}")
    with kernels.using(f"attention:{path}"), torch.autocast("cpu", dtype=torch.bfloat16):
        out = model.loss(ids)
    out.loss.backward()  # outside autocast, as PyTorch advises
    assert seen and all(d == (torch.bfloat16,) * 3 for d in seen), seen
    assert all(p.grad is not None and p.grad.dtype == torch.float32 and p.grad.isfinite().all()
               for p in model.parameters())
    torch.testing.assert_close(out.loss, want, rtol=2e-2, atol=0)  # bf16 matmuls: ~1e-2 of the loss


def test_flex_attention_under_bf16_autocast_gets_one_dtype(monkeypatch):
    # FlexAttention has no backward on the CPU: the forward of the training step, in training mode.
    from zoo.components.kernels import attention as flex

    model = tiny("gemma2-2b", **{"layers.local.mixer.window": 4})
    ids = torch.randint(0, 150, (2, 11))
    seen = record_attention_inputs(monkeypatch, flex, "flex_attention")
    with torch.no_grad():
        with kernels.using("off"), torch.autocast("cpu", dtype=torch.bfloat16):
            want = model.loss(ids).loss
        with kernels.using("attention:flex"), torch.autocast("cpu", dtype=torch.bfloat16):
            got = model.loss(ids).loss
    assert len(seen) == 2 and all(d == (torch.bfloat16,) * 3 for d in seen), seen
    torch.testing.assert_close(got, want, rtol=1e-2, atol=0)


def test_fused_loss_sums_a_bf16_weight_gradient_in_fp32_by_default(monkeypatch):
    """Relative error (Frobenius) of the bf16 weight gradient against fp64 from the same bf16
    inputs: summed in float32 over 128 chunks, each chunk's bf16 product rounded once (on the CPU;
    on CUDA the GEMM's float32 result is added, and test_kernels_cuda asserts one chunk's error), it
    stays within 1.5x of one chunk's (the error of the bf16 logits and gradient rows), which summing
    in bf16 does not."""
    from zoo.components.kernels import cross_entropy

    torch.manual_seed(0)
    n, d, v = 128, 8, 1024
    assert n // cross_entropy._chunk_rows(n, d, v) == 128
    h = torch.randn(n, d).bfloat16()
    w = (torch.randn(v, d) * 0.5).bfloat16().requires_grad_()
    labels = torch.randint(0, v, (n,))
    w64 = w.detach().double().requires_grad_()
    (ref,) = torch.autograd.grad(F.cross_entropy(h.double() @ w64.T, labels), w64)

    def error(**kw):
        (g,) = torch.autograd.grad(cross_entropy.fused_linear_cross_entropy(h, w, labels, **kw)[0], w)
        assert g.dtype == torch.bfloat16
        return float((g.double() - ref).norm() / ref.norm())

    default, in_bf16 = error(), error(accumulate_dtype=torch.bfloat16)
    monkeypatch.setattr(cross_entropy, "_chunk_rows", lambda n, d, v: n)
    one_chunk = error()
    assert default <= 1.5 * one_chunk, (default, one_chunk)
    assert in_bf16 > 2 * one_chunk, (in_bf16, one_chunk)  # what the default avoids


class Products(TorchDispatchMode):
    """The operand dtypes of every matrix product the fused loss runs, inside its custom operators
    too (their functions are run under this mode instead of the opaque operators)."""

    PRODUCTS = {"mm", "addmm", "addmm_", "bmm", "baddbmm", "baddbmm_", "matmul", "linear"}

    def __init__(self, module):
        super().__init__()
        self.inside = {module._forward_op._opoverload: module._forward, module._backward_op._opoverload: module._backward}
        self.seen = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in self.inside:
            with self:
                return self.inside[func](*args, **(kwargs or {}))
        if func.overloadpacket.__name__ in self.PRODUCTS:
            self.seen.append((func.overloadpacket.__name__,) + tuple(
                a.dtype for a in args if isinstance(a, torch.Tensor) and a.dim() == 2))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("path", ["one pass", "two passes"])
@pytest.mark.parametrize("autocast", [False, True], ids=["bf16 weights", "fp32 weights under bf16 autocast"])
def test_every_head_product_of_the_fused_loss_takes_bf16_operands(monkeypatch, path, autocast):
    """Every product with the head, forward and backward, with one vocabulary block or several, takes
    bf16 operands (fp32 sums are added to outside the product): none is a float32 GEMM, which runs
    on CUDA cores at a fifteenth of the tensor cores' rate."""
    from zoo.components.kernels import cross_entropy

    if path == "two passes":
        monkeypatch.setattr(cross_entropy, "FORWARD_SUM_BYTES", -1)
    torch.manual_seed(0)
    dtype = torch.float32 if autocast else torch.bfloat16
    h = torch.randn(40, 16, dtype=dtype, requires_grad=True)
    w = torch.randn(3000, 16, dtype=dtype, requires_grad=True)  # three backward blocks
    labels = torch.randint(0, 3000, (40,))
    with Products(cross_entropy) as mode:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            loss = cross_entropy.fused_linear_cross_entropy(h, w, labels)[0]
        loss.backward()
    assert len(mode.seen) >= 3, mode.seen  # the logits, and the two gradients' products at least
    assert all(d == torch.bfloat16 for op in mode.seen for d in op[1:]), mode.seen
    assert h.grad.dtype == w.grad.dtype == dtype and torch.isfinite(w.grad).all()


def test_fused_loss_refuses_labels_outside_the_vocabulary():
    from zoo.components.kernels.cross_entropy import fused_linear_cross_entropy

    h, w = torch.randn(5, 8), torch.randn(40, 8)
    for bad in (40, -1, 1000):
        labels = torch.tensor([1, 2, bad, 3, -100])
        with pytest.raises(RuntimeError, match=r"labels must lie in \[0, 40\).*ignore_index -100"):
            fused_linear_cross_entropy(h, w, labels)
    loss = fused_linear_cross_entropy(h, w, torch.tensor([1, 2, 39, 0, -100]))[0]
    torch.testing.assert_close(loss, F.cross_entropy(h[:4] @ w.T, torch.tensor([1, 2, 39, 0])))


class FullSizeResults(TorchDispatchMode):
    """Names the operations that produce a new tensor of at least ``numel`` elements, inside the
    fused loss's backward operator too (``inside``: a custom operator and the function it runs)."""

    def __init__(self, numel, inside=None):
        super().__init__()
        self.numel, self.ops, self.inside = numel, [], inside

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if self.inside is not None and func is self.inside[0]._opoverload:
            with self:
                return self.inside[1](*args, **(kwargs or {}))
        out = func(*args, **(kwargs or {}))
        name = func.overloadpacket.__name__
        if isinstance(out, torch.Tensor) and out.numel() >= self.numel and not name.endswith("_"):
            self.ops.append(name)
        return out


def fused_loss_memory(monkeypatch, forward_sum_bytes):
    """What the fused loss holds from its forward to its backward beyond its inputs (bytes), and the
    operations of its backward that make a new tensor of the head's size."""
    from zoo.components.kernels import cross_entropy

    monkeypatch.setattr(cross_entropy, "FORWARD_SUM_BYTES", forward_sum_bytes)
    torch.manual_seed(0)
    n, d, v = 64, 32, 4096
    h = torch.randn(n, d, dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(v, d, dtype=torch.bfloat16, requires_grad=True)
    labels = torch.randint(0, v, (n,))
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        loss = cross_entropy.fused_linear_cross_entropy(h, w, labels)[0]
    inputs = {t.untyped_storage().data_ptr() for t in (h, w, labels)}
    held = sum(t.numel() * t.element_size() for t in saved if t.untyped_storage().data_ptr() not in inputs)
    with FullSizeResults(w.numel(), inside=(cross_entropy._backward_op, cross_entropy._backward)) as seen:
        loss.backward()
    return held, [op for op in seen.ops if op != "detach"], (n, d, v)  # detach: a view


def test_fused_loss_in_two_passes_keeps_no_gradient_from_forward_to_backward(monkeypatch):
    """When the weight gradient's float32 sum would not fit ``FORWARD_SUM_BYTES``: between the forward
    and the backward the fused loss holds, beyond its inputs, one float per token (the log-partition)
    and the mean's 1/n; the backward allocates one head-sized tensor, the gradient it returns (the
    float32 sums it adds up are one vocabulary block's)."""
    held, ops, (n, d, v) = fused_loss_memory(monkeypatch, 4 * 4096 * 32 - 1)
    assert held <= 4 * n + 4, held  # the float32 head gradient alone would be 4 * v * d
    assert ops == ["empty_like"], ops


def test_fused_loss_in_one_pass_holds_only_the_gradients_it_returns(monkeypatch):
    """When it fits: the forward computes the gradients (three head products, not four) and holds
    them, in their own dtype, until the backward, which scales them by the incoming gradient."""
    held, ops, (n, d, v) = fused_loss_memory(monkeypatch, 4 * 4096 * 32)
    assert held == 2 * (n * d + v * d), held
    assert ops == ["mul"], ops


def test_fused_loss_gradients_accumulate_and_a_second_backward_repeats_them():
    from zoo.components.kernels.cross_entropy import fused_linear_cross_entropy

    h = torch.randn(30, 8, requires_grad=True)
    w = torch.randn(300, 8, requires_grad=True)
    labels = torch.randint(0, 300, (30,))
    (g1,) = torch.autograd.grad(fused_linear_cross_entropy(h, w, labels)[0], w)
    w.grad = torch.ones_like(w)  # gradient accumulation: the second micro-batch adds to it
    loss = fused_linear_cross_entropy(h, w, labels)[0] / 4
    loss.backward(retain_graph=True)
    torch.testing.assert_close(w.grad, 1 + g1 / 4)
    loss.backward()  # the backward recomputes from the saved inputs: the same gradient again
    torch.testing.assert_close(w.grad, 1 + g1 / 2)


def test_kernels_launch_on_their_tensors_device(monkeypatch):
    from zoo.components import kernels as fast
    from zoo.components.kernels import cross_entropy, glu, norms, rope

    guard = fast.on_device(types.SimpleNamespace(device=torch.device("cuda", 1)))
    assert isinstance(guard, torch.cuda.device) and guard.idx == 1  # entered only at launch
    launched = []
    for module in (norms, rope, glu, cross_entropy):
        monkeypatch.setattr(module, "on_device", lambda t, m=module: launched.append((m.__name__, t.device))
                            or fast.on_device(t))
    model = tiny("gemma2-2b")
    with kernels.using("triton"):
        model.loss(torch.randint(0, 150, (2, 7))).loss.backward()
    assert {m.rsplit(".", 1)[1] for m, _ in launched} == {"norms", "rope", "glu", "cross_entropy"}
    assert all(d == torch.device("cpu") for _, d in launched)


# -- MoE under autocast ---------------------------------------------------------------------------

def moe_model(name, dispatch, d_model=32, d_ff=48):
    """A tiny preset with one layer of each kind and its MoE layers dispatching as asked."""
    from zoo.testing import one_of_each

    data = one_of_each(name, d_model=d_model, d_ff=d_ff, vocab_size=150).to_dict()
    for layer in data["layers"].values():
        if layer.get("ffn", {}).get("name") == "moe":
            layer["ffn"]["dispatch"] = dispatch
    return zoo.build_model(zoo.ModelSpec.from_dict(data), seed=0)


def reference_moe(moe, x):
    """The MoE written out token by token and expert by expert: the routing in float32 with autocast
    off (routers run in float32), each expert's matmuls as autocast runs them, the weighted sum in
    float32."""
    with torch.autocast("cpu", enabled=False):
        r = moe.route(x)
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for j in range(r.indices.shape[1]):
            e = int(r.indices[t, j])
            h = F.linear(x[t], moe.experts.w_up[e])
            h = moe.act(F.linear(x[t], moe.experts.w_gate[e])) * h if moe.gated else moe.act(h)
            out[t] += r.weights[t, j] * F.linear(h, moe.experts.w_down[e]).to(x.dtype)
    if moe.shared is not None:
        s = moe.shared(x)
        out = out + (torch.sigmoid(moe.shared_gate(x)) * s if moe.shared_gate is not None else s)
    return out


def moe_outputs(moe, fn, x, cotangent, autocast):
    """The output and the gradients of the input and of each expert stack and the router."""
    moe.zero_grad(set_to_none=True)
    x = x.clone().requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        y = fn(moe, x)
    (y.to(cotangent.dtype) * cotangent).sum().backward()
    return [y.detach(), x.grad] + [w.grad for w in (moe.experts.w_up, moe.experts.w_down, moe.experts.w_gate) if w is not None]


@pytest.mark.parametrize("name", ["qwen3-30b-a3b", "deepseek-v3", "mixtral-8x7b"])
@pytest.mark.parametrize("dispatch", ["loop", "auto"])
def test_moe_under_bf16_autocast_over_fp32_weights_is_as_close_to_fp64_as_the_reference(name, dispatch):
    """The loop dispatch (taken under torch.compile and where the grouped matmul does not run) and
    the automatic choice, under bf16 autocast over float32 weights: output and gradients are within
    1.5x of the error a token-by-token reference has under the same autocast, both against float64;
    in float32 within 3x of the reference's float32 error."""
    import copy

    model = moe_model(name, dispatch)
    moe = next(layer.ffn for layer in model.layers if type(layer.ffn).__name__ == "MoE")
    gen = torch.Generator().manual_seed(0)
    x, cotangent = torch.randn(24, 32, generator=gen), torch.randn(24, 32, generator=gen)
    truth = moe_outputs(copy.deepcopy(moe).double(), reference_moe, x.double(), cotangent.double(), False)

    def rel(got, want):
        return float((got.double() - want).norm() / want.norm())

    for autocast, bound in ((True, 1.5), (False, 3.0)):
        got = moe_outputs(moe, lambda m, t: m(t), x, cotangent, autocast)
        ref = moe_outputs(moe, reference_moe, x, cotangent, autocast)
        assert got[0].dtype == torch.float32 and all(g.dtype == torch.float32 for g in got[1:])
        for what, g, r, t in zip(["output", "x.grad", "w_up.grad", "w_down.grad", "w_gate.grad"], got, ref, truth):
            assert rel(g, t) <= bound * rel(r, t), (what, autocast, rel(g, t), rel(r, t))


@pytest.mark.parametrize("dispatch", ["loop", "auto"])
def test_a_moe_training_step_under_bf16_autocast_over_fp32_weights(dispatch):
    model = moe_model("deepseek-v3", dispatch).train()
    ids = torch.randint(0, 150, (2, 11), generator=torch.Generator().manual_seed(0))
    with kernels.using("off"):
        want = model.loss(ids).ce
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = model.loss(ids)
    out.loss.backward()
    assert all(p.grad is not None and p.grad.dtype == torch.float32 and p.grad.isfinite().all()
               for p in model.parameters())
    torch.testing.assert_close(out.ce, want, rtol=2e-2, atol=0)  # bf16 matmuls: ~1e-2 of the loss, as above

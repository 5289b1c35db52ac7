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
    inputs: summed over 128 chunks it must be no worse than in one chunk (the error of the bf16
    logits and gradient rows), which summing in bf16 is not."""
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
    assert default <= 1.05 * one_chunk, (default, one_chunk)
    assert in_bf16 > 2 * one_chunk, (in_bf16, one_chunk)  # what the default avoids


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
    """Names the operations that produce a new tensor of at least ``numel`` elements."""

    def __init__(self, numel):
        super().__init__()
        self.numel, self.ops = numel, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func.overloadpacket.__name__
        if isinstance(out, torch.Tensor) and out.numel() >= self.numel and not name.endswith("_"):
            self.ops.append(name)
        return out


def test_fused_loss_backward_scales_the_gradients_in_place():
    from zoo.components.kernels.cross_entropy import fused_linear_cross_entropy

    h = torch.randn(30, 8, requires_grad=True)
    w = torch.randn(300, 8, requires_grad=True)
    labels = torch.randint(0, 300, (30,))
    (g1,) = torch.autograd.grad(fused_linear_cross_entropy(h, w, labels)[0], w)
    w.grad = torch.zeros_like(w)  # gradient accumulation: the second micro-batch adds to it
    loss = fused_linear_cross_entropy(h, w, labels)[0] / 4
    with FullSizeResults(w.numel()) as seen:
        loss.backward()
    assert seen.ops == [], seen.ops
    torch.testing.assert_close(w.grad, g1 / 4)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss2 = fused_linear_cross_entropy(h, w, labels)[0]
        loss2.backward(retain_graph=True)
        loss2.backward()  # the saved gradients were scaled in place: a second pass is refused


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

"""The gated product of a GLU feed-forward, ``act(gate) * up``, fused into one kernel per
direction: SiLU (SwiGLU), GeLU exact or tanh (GeGLU) and ReLU (ReGLU). Computed in fp32, rounded
once to the input dtype."""

import torch
import triton
import triton.language as tl

from zoo.components.kernels import on_device

ACTIVATIONS = {"silu": 0, "gelu": 1, "gelu_tanh": 2, "relu": 3}
BLOCK = 1024


@triton.jit
def _tanh(x):
    return 2.0 * tl.sigmoid(2.0 * x) - 1.0


@triton.jit
def _act_and_grad(g, ACT: tl.constexpr):
    """act(g) and act'(g), in fp32."""
    if ACT == 0:
        s = tl.sigmoid(g)
        a = g * s
        d = s * (1.0 + g * (1.0 - s))
    elif ACT == 1:
        cdf = 0.5 * (1.0 + tl.erf(g * 0.7071067811865476))
        a = g * cdf
        d = cdf + g * tl.exp(-0.5 * g * g) * 0.3989422804014327
    elif ACT == 2:
        t = _tanh(0.7978845608028654 * (g + 0.044715 * g * g * g))
        a = 0.5 * g * (1.0 + t)
        d = 0.5 * (1.0 + t) + 0.5 * g * (1.0 - t * t) * 0.7978845608028654 * (1.0 + 3 * 0.044715 * g * g)
    else:
        a = tl.maximum(g, 0.0)
        d = tl.where(g > 0, 1.0, 0.0)
    return a, d


@triton.jit
def _glu_fwd(G, U, Y, n, ACT: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    g = tl.load(G + offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(U + offs, mask=mask, other=0.0).to(tl.float32)
    a, _ = _act_and_grad(g, ACT)
    tl.store(Y + offs, (a * u).to(Y.dtype.element_ty), mask=mask)


@triton.jit
def _glu_bwd(G, U, DY, DG, DU, n, ACT: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    g = tl.load(G + offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(U + offs, mask=mask, other=0.0).to(tl.float32)
    dy = tl.load(DY + offs, mask=mask, other=0.0).to(tl.float32)
    a, da = _act_and_grad(g, ACT)
    tl.store(DG + offs, (dy * u * da).to(DG.dtype.element_ty), mask=mask)
    tl.store(DU + offs, (dy * a).to(DU.dtype.element_ty), mask=mask)


class _GatedProduct(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate, up, act):
        gate, up = gate.contiguous(), up.contiguous()
        y = torch.empty_like(gate)
        n = gate.numel()
        with on_device(gate):
            _glu_fwd[(triton.cdiv(n, BLOCK),)](gate, up, y, n, ACT=act, BLOCK=BLOCK)
        ctx.save_for_backward(gate, up)
        ctx.act = act
        return y

    @staticmethod
    def backward(ctx, dy):
        gate, up = ctx.saved_tensors
        dy = dy.contiguous()
        dg, du = torch.empty_like(gate), torch.empty_like(up)
        n = gate.numel()
        with on_device(gate):
            _glu_bwd[(triton.cdiv(n, BLOCK),)](gate, up, dy, dg, du, n, ACT=ctx.act, BLOCK=BLOCK)
        return dg, du, None


def gated_product(gate: torch.Tensor, up: torch.Tensor, activation: str) -> torch.Tensor:
    """``act(gate) * up`` for ``activation`` in silu, gelu, gelu_tanh, relu."""
    if gate.shape != up.shape or gate.dtype != up.dtype:
        raise ValueError(f"gate {tuple(gate.shape)} {gate.dtype} and up {tuple(up.shape)} {up.dtype} must match")
    return _GatedProduct.apply(gate, up, ACTIVATIONS[activation])


def glu_module(module, x):
    """A GLU feed-forward (``components.ffn.GLU``) with the gated product fused."""
    return module.down(gated_product(module.gate(x), module.up(x), module.act.fused_name))

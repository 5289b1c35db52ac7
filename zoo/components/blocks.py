"""Transformer blocks: where the norms sit and how the token mixer and the FFN meet the residual stream.

``Attn`` below is the layer's token mixer (attention, or a recurrent or latent mixer).
``serial`` with ``norm_position``:
  - ``pre``      (GPT-2/3, Llama):  h = x + Attn(N(x));            y = h + FFN(N(h))
  - ``post``     (2017):            h = N(x + Attn(x));            y = N(h + FFN(h))
  - ``sandwich`` (Gemma 2/3):       h = x + N(Attn(N(x)));         y = h + N(FFN(N(h)))
  - ``output``   (OLMo 2):          h = x + N(Attn(x));            y = h + N(FFN(h))
``parallel`` (GPT-J, PaLM, GPT-NeoX, Falcon): y = x + Attn(N1(x)) + FFN(N2(x)), N2 = N1 when shared.

    x ──┬──────────────────────────────┐           (serial, pre-norm)
        └─ N ─ mixer(·, ctx, pos) ──── + ── h ──┬──────────────────────┐
                                                └─ N ─ FFN(·, ctx) ──── + ── y

Every block stores its token mixer as ``mixer`` (its parameters are ``layers.{i}.mixer.*`` whatever
kind it is), its FFN as ``ffn``, and its norms as ``attn_norm``/``ffn_norm`` (and ``attn_out_norm``/
``ffn_out_norm`` where the placement has them). The FFN gets the forward context too, to add
auxiliary losses (a mixture of experts' balance); one written to take ``x`` alone is called so.
"""

from dataclasses import dataclass
from typing import Literal

from torch import nn

from zoo.components.mixers.none import NoMixer
from zoo.core.deprecations import warn
from zoo.core.kinds import Block, takes_ctx
from zoo.core.registry import register


class _Block(Block):
    def __init__(self, *, spec, layer, index):
        super().__init__()
        d = spec.d_model
        self.mixer = layer.mixer.build(d_model=d, layer=layer, spec=spec, index=index)
        self.ffn = layer.ffn.build(d_model=d)
        self._ffn_ctx = takes_ctx(self.ffn)
        self.drop = nn.Dropout(spec.dropout)
        self._norm_part, self._d = layer.norm, d

    @property
    def attention(self) -> nn.Module:
        """The mixer's name before mixers (deprecated): :attr:`mixer`."""
        warn("a block's .attention")
        return self.mixer

    def _norm(self):
        return self._norm_part.build(dim=self._d)

    def _ffn(self, x, ctx):
        return self.ffn(x, ctx) if self._ffn_ctx else self.ffn(x)


@register("block", "serial")
class Serial(_Block):
    """Attention, then FFN, each on the residual stream; norms where ``norm_position`` says."""

    @dataclass(frozen=True)
    class Config:
        norm_position: Literal["pre", "post", "sandwich", "output"] = "pre"

    def __init__(self, cfg, *, spec, layer, index):
        super().__init__(spec=spec, layer=layer, index=index)
        self.where = cfg.norm_position
        if self.where in ("pre", "post", "sandwich"):
            self.attn_norm, self.ffn_norm = self._norm(), self._norm()
        if self.where in ("sandwich", "output"):
            self.attn_out_norm, self.ffn_out_norm = self._norm(), self._norm()

    def forward(self, x, ctx, pos):
        w = self.where
        if w == "pre":
            h = x + self.drop(self.mixer(self.attn_norm(x), ctx, pos))
            return h + self.drop(self._ffn(self.ffn_norm(h), ctx))
        if w == "post":
            h = self.attn_norm(x + self.drop(self.mixer(x, ctx, pos)))
            return self.ffn_norm(h + self.drop(self._ffn(h, ctx)))
        if w == "sandwich":
            h = x + self.drop(self.attn_out_norm(self.mixer(self.attn_norm(x), ctx, pos)))
            return h + self.drop(self.ffn_out_norm(self._ffn(self.ffn_norm(h), ctx)))
        h = x + self.drop(self.attn_out_norm(self.mixer(x, ctx, pos)))
        return h + self.drop(self.ffn_out_norm(self._ffn(h, ctx)))


@register("block", "parallel")
class Parallel(_Block):
    """Attention and FFN read the same input and add to the stream together."""

    @dataclass(frozen=True)
    class Config:
        shared_norm: bool = True

    def __init__(self, cfg, *, spec, layer, index):
        super().__init__(spec=spec, layer=layer, index=index)
        self.attn_norm = self._norm()
        self.ffn_norm = None if cfg.shared_norm else self._norm()

    def forward(self, x, ctx, pos):
        a = self.attn_norm(x)
        f = a if self.ffn_norm is None else self.ffn_norm(x)
        return x + self.drop(self.mixer(a, ctx, pos)) + self.drop(self._ffn(f, ctx))


@register("block", "ffn_only")
class FFNOnly(Block):
    """``y = x + FFN(N(x))``: one norm, the layer's FFN, the residual. The layer's ``mixer`` setting is
    not built."""

    attention = _Block.attention  # deprecated: .mixer
    @dataclass(frozen=True)
    class Config:
        pass

    def __init__(self, cfg, *, spec, layer, index):
        super().__init__()
        self.mixer = NoMixer()
        self.ffn = layer.ffn.build(d_model=spec.d_model)
        self._ffn_ctx = takes_ctx(self.ffn)
        self.ffn_norm = layer.norm.build(dim=spec.d_model)
        self.drop = nn.Dropout(spec.dropout)

    def forward(self, x, ctx, pos):
        h = self.ffn_norm(x)
        return x + self.drop(self.ffn(h, ctx) if self._ffn_ctx else self.ffn(h))


@register("block", "mixer_only")
class MixerOnly(Block):
    """``y = x + mixer(N(x))``: a layer with a token mixer and no FFN (Mamba-2's block, one norm). The
    layer's ``ffn`` setting is not built and computes nothing."""

    attention = _Block.attention  # deprecated: .mixer
    @dataclass(frozen=True)
    class Config:
        pass

    def __init__(self, cfg, *, spec, layer, index):
        super().__init__()
        self.mixer = layer.mixer.build(d_model=spec.d_model, layer=layer, spec=spec, index=index)
        self.ffn = None
        self.attn_norm = layer.norm.build(dim=spec.d_model)
        self.drop = nn.Dropout(spec.dropout)

    def forward(self, x, ctx, pos):
        return x + self.drop(self.mixer(self.attn_norm(x), ctx, pos))


@register("block", "scaled_residual")
class ScaledResidual(_Block):
    """A block whose residual is the *normed* input, each branch and residual scaled (MiniMax)::

        a = N1(x);  h = attn_alpha * a + attn_beta * Mixer(a)
        b = N2(h);  y = ffn_alpha * b + ffn_beta * FFN(b)
    """

    @dataclass(frozen=True)
    class Config:
        attn_alpha: float = 1.0
        attn_beta: float = 1.0
        ffn_alpha: float = 1.0
        ffn_beta: float = 1.0

    def __init__(self, cfg, *, spec, layer, index):
        super().__init__(spec=spec, layer=layer, index=index)
        self.cfg = cfg
        self.attn_norm, self.ffn_norm = self._norm(), self._norm()

    def forward(self, x, ctx, pos):
        c = self.cfg
        a = self.attn_norm(x)
        h = c.attn_alpha * a + c.attn_beta * self.drop(self.mixer(a, ctx, pos))
        b = self.ffn_norm(h)
        return c.ffn_alpha * b + c.ffn_beta * self.drop(self._ffn(b, ctx))

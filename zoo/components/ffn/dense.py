"""Feed-forward networks: the two-matrix MLP and the gated (GLU) family: SwiGLU, GeGLU, ReGLU."""

import math
from dataclasses import dataclass
from typing import ClassVar, Literal, Optional

from torch import nn

from zoo.core import kernels
from zoo.core.kinds import FFN
from zoo.core.spec import build_part
from zoo.core.registry import register
from zoo.core.spec import Part, SpecError, part_field


def derive_d_ff(d_model: int, rule: str, multiple_of: int = 1, multiplier: Optional[float] = None) -> int:
    """d_ff from d_model: ``4x``; ``8/3`` (GLU's parameter-matched width); ``8/3_scaled``
    (``int(2/3 * 4d)`` times ``ffn_dim_multiplier``, the rule Llama 2 and 3 publish); each
    rounded up to ``multiple_of``."""
    if rule == "4x":
        hidden = 4 * d_model
    elif rule == "8/3":
        hidden = math.ceil(8 * d_model / 3)
    elif rule == "8/3_scaled":
        hidden = int(2 * 4 * d_model / 3)
        if multiplier is not None:
            hidden = int(multiplier * hidden)
    else:
        raise ValueError(f"unknown d_ff rule {rule!r}")
    return multiple_of * math.ceil(hidden / multiple_of)


def _check(cfg) -> None:
    if cfg.d_ff is not None and cfg.d_ff <= 0:
        raise SpecError("d_ff", f"must be positive, got {cfg.d_ff}")
    if cfg.multiple_of <= 0:
        raise SpecError("multiple_of", f"must be positive, got {cfg.multiple_of}")
    if cfg.ffn_dim_multiplier is not None and cfg.d_ff_rule != "8/3_scaled":
        raise SpecError("ffn_dim_multiplier", "only applies with d_ff_rule = '8/3_scaled'")


@register("ffn", "mlp")
class MLP(FFN):
    """``down(act(up(x)))``: the original two-matrix FFN."""

    @dataclass(frozen=True)
    class Config:
        d_ff: Optional[int] = None
        d_ff_rule: Literal["4x", "8/3", "8/3_scaled"] = "4x"
        multiple_of: int = 1
        ffn_dim_multiplier: Optional[float] = None
        activation: Part = part_field("activation", "gelu")
        bias: bool = True
        check = _check

    gated = False

    def __init__(self, cfg, *, d_model: int):
        super().__init__()
        self.cfg = cfg
        self.d_ff = cfg.d_ff or derive_d_ff(d_model, cfg.d_ff_rule, cfg.multiple_of, cfg.ffn_dim_multiplier)
        if self.gated:
            self.gate = nn.Linear(d_model, self.d_ff, bias=cfg.bias)
        self.up = nn.Linear(d_model, self.d_ff, bias=cfg.bias)
        self.down = nn.Linear(self.d_ff, d_model, bias=cfg.bias)
        self.act = build_part(cfg.activation, "activation")

    def forward(self, x, ctx=None):
        fast = kernels.fast(self, x)
        if fast is not None:
            return fast(self, x)
        if self.gated:
            return self.down(self.act(self.gate(x)) * self.up(x))
        return self.down(self.act(self.up(x)))

    def kernel_problem(self, backend, x=None, forced=False):
        if self.act.fused_name is None:
            return f"activation {type(self.act).__name__} has no fused gated product"
        return None

    # -- what this part states about itself ---------------------------------------------------------
    #: Tensor parallelism: the sequence gathered, ``up`` (and ``gate``) sharded by their d_ff rows, ``down``
    #: by its d_ff columns and reduce-scattered back onto the sequence slice (``gate``: the gated kinds').
    tp_plan = {"": "gather_sequence", "gate": "colwise", "up": "colwise", "down": "rowwise"}
    tp_divides = ("d_ff",)

    def facts(self) -> dict:
        return {"d_ff": self.d_ff}

    def activation_bytes(self, seq_len, dtype, *, tp=1, device="cuda"):
        """Its input (the whole sequence, gathered under tensor parallelism) and, per d_ff feature of its
        share, what the activation and the matmuls keep: ``up``'s output and the product ``down`` reads;
        gated, the gate's output and its activation too (the fused kernel on CUDA keeps gate and up)."""
        c = dtype.itemsize
        per_feature = (3 if device == "cuda" else 4) if self.gated else 2
        return self.up.in_features * c + per_feature * c * self.d_ff / tp

    @classmethod
    def resolved(cls, cfg, d_model: int) -> dict:
        """The settings with the width computed (rule, multiple and multiplier folded into ``d_ff``)."""
        from zoo.core.spec import to_dict

        out = {k: v for k, v in to_dict(cfg).items() if k not in ("d_ff_rule", "multiple_of", "ffn_dim_multiplier")}
        out["d_ff"] = cfg.d_ff or derive_d_ff(d_model, cfg.d_ff_rule, cfg.multiple_of, cfg.ffn_dim_multiplier)
        return out

    @staticmethod
    def shrink(cfg, *, d_ff: int = 64, **_) -> dict:
        """A tiny test copy keeps its rule, or gets width ``d_ff`` when the width is set."""
        return {"d_ff": d_ff} if cfg.d_ff is not None else {}


@register("ffn", "glu")
class GLU(MLP):
    """``down(act(gate(x)) * up(x))``: the gated FFN with any activation."""

    kernel: ClassVar[str] = "glu"  # act(gate) * up fused in one kernel
    kernel_on_shards: ClassVar[str] = "layers"  # x reaches only gate and up, whose outputs are local
    backends: ClassVar[tuple] = ("triton", "torch")

    @dataclass(frozen=True)
    class Config(MLP.Config):
        d_ff_rule: Literal["4x", "8/3", "8/3_scaled"] = "8/3"
        activation: Part = part_field("activation", "silu")
        bias: bool = False

    gated = True


@register("ffn", "swiglu")
class SwiGLU(GLU):
    """GLU with SiLU (Llama, PaLM, Mistral, OLMo 2)."""

    @dataclass(frozen=True)
    class Config(GLU.Config):
        activation: Part = part_field("activation", "silu")


@register("ffn", "geglu")
class GeGLU(GLU):
    """GLU with GeLU (Gemma uses the tanh approximation)."""

    @dataclass(frozen=True)
    class Config(GLU.Config):
        activation: Part = part_field("activation", "gelu")


@register("ffn", "reglu")
class ReGLU(GLU):
    """GLU with ReLU."""

    @dataclass(frozen=True)
    class Config(GLU.Config):
        activation: Part = part_field("activation", "relu")

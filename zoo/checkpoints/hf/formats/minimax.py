"""MiniMax-Text-01 (``minimax``): lightning-attention layers and softmax-attention layers as its
``layer_types`` list says, a Mixtral-style MoE FFN in every layer, and the residual taken after each
norm with its own alpha/beta scales (the ``scaled_residual`` block).

Its softmax attention, experts, router, norms and RoPE are Mixtral's (so are its tensor names); the
lightning layers are zoo's ``lightning_attention``. Their decay slopes are stored as the buffer
``slope_rate`` (H, 1, 1) and loaded from it; the decay tables transformers derives from the slopes
for its ``block_size`` (``query_decay``, ``key_decay``, ``diagonal_decay``) are not read, and are
written again from the slopes on saving.

The RoPE follows the release where transformers differs from it. MiniMax-Text-01 and M1 rotate half
of each head ("RoPE applied to half of the attention head dimension", the model card): their
config.json says ``rotary_dim: 64`` of ``head_dim`` 128, and the release's own code and vLLM rotate
the first ``rotary_dim`` channels (half-split, frequencies over ``rotary_dim``) and pass the rest.
transformers 5.23's ``minimax`` does not read ``rotary_dim`` and rotates the whole head; zoo reads
it, and writes it back on saving (tests/formats/test_minimax.py checks zoo against the release's
equations and pins transformers' reading).
"""

from __future__ import annotations

from typing import Any

import torch

from zoo.checkpoints.hf.common import activation_name, pattern
from zoo.checkpoints.hf.format import Fields
from zoo.checkpoints.hf.formats.llama import LAYER, TINY
from zoo.checkpoints.hf.formats.moe import Mixtral
from zoo.checkpoints.hf.maps import Transform, ZOO_MIXER, rule
from zoo.core.spec import ModelSpec

LINEAR, FULL = "linear_attention", "full_attention"
KINDS = {LINEAR: "linear", FULL: "full"}
ALPHAS = {  # block field -> config field, per layer type
    LINEAR: {"attn_alpha": "linear_attn_alpha_factor", "attn_beta": "linear_attn_beta_factor"},
    FULL: {"attn_alpha": "full_attn_alpha_factor", "attn_beta": "full_attn_beta_factor"},
}
MLP_ALPHAS = {"ffn_alpha": "mlp_alpha_factor", "ffn_beta": "mlp_beta_factor"}
LIGHTNING_NORM_EPS = 1e-6  # transformers' lightning output norm does not take rms_norm_eps

DECAY_TABLES = ("query_decay", "key_decay", "diagonal_decay")


def decay_tables(slope: torch.Tensor, block: int) -> list[torch.Tensor]:
    """The decay tables transformers derives from an (H, 1, 1) slope column for blocks of ``block``
    tokens, computed as it computes them (so a saved checkpoint holds exactly what it would)."""
    steps = torch.arange(block, device=slope.device) + 1
    query = torch.exp(-slope * steps[:, None])
    key = torch.exp(-slope * (block - steps[:, None]))
    diagonal = slope * (steps[:, None] - steps[None, :])[None, None, :, :]
    diagonal = torch.exp(torch.where(diagonal >= 0, -diagonal, float("-inf")))
    return [query, key, diagonal]


def slopes(block: int) -> Transform:
    """transformers keeps the slopes as an (H, 1, 1) column beside three tables derived from them;
    zoo keeps the slopes (H,). Loading reads the column; saving writes the column and the tables."""
    def to_hf(ts, h):
        column = ts[0].reshape(-1, 1, 1).clone()
        return [column, *decay_tables(column, block)]

    def to_zoo(ts, h):
        column, tables = ts[0], ts[1:]
        want = [tuple(t.shape) for t in decay_tables(torch.zeros(column.shape, device="meta"), block)]
        for name, t, shape in zip(DECAY_TABLES, tables, want):
            if tuple(t.shape) != shape:  # the file's tables were made for another block_size
                raise ValueError(f"the stored {name} has the shape {tuple(t.shape)}, but block_size {block} in "
                                 f"config.json gives {shape}; set block_size to the one the tables were made with")
        return [column.reshape(-1)]

    return Transform("slope_column", to_zoo, to_hf)


class MiniMax(Mixtral):
    model_type, architecture = "minimax", "MiniMaxForCausalLM"
    defaults = {**Mixtral.defaults, "block_size": 256}
    tiny = {**TINY, "num_hidden_layers": 4, "num_local_experts": 4, "num_experts_per_tok": 2, "intermediate_size": 48,
            "layer_types": [LINEAR, LINEAR, FULL, LINEAR], "block_size": 6,
            "full_attn_alpha_factor": 1.5, "full_attn_beta_factor": 0.8, "linear_attn_alpha_factor": 1.25,
            "linear_attn_beta_factor": 0.9, "mlp_alpha_factor": 1.1, "mlp_beta_factor": 0.7}

    @property
    def extra_fields(self) -> tuple[str, ...]:
        return super().extra_fields + ("layer_types", "block_size", "rotary_dim", *MLP_ALPHAS.values(),
                                       *(k for t in ALPHAS.values() for k in t.values()))

    # -- the weight-name map --------------------------------------------------------------------
    def rules(self, spec):
        a, z = f"{LAYER}self_attn.", f"{ZOO_MIXER}"
        chunks = {spec.layer(i).mixer.chunk for i in range(spec.n_layers) if spec.layer(i).mixer.name == "lightning_attention"}
        return super().rules(spec) + [
            *(rule(f"{a}{p}.weight", f"{z}{p}.weight") for p in ("qkv_proj", "output_gate", "norm", "out_proj")),
            rule([f"{a}slope_rate", *(a + t for t in DECAY_TABLES)], f"{z}slope", slopes(max(chunks, default=1))),
        ]

    # -- config -> spec -------------------------------------------------------------------------
    def layer_kinds(self, f: Fields, n_layers: int) -> list[str]:
        types = f.get("layer_types", kind=list)
        if types is None:  # MiniMaxConfig's default: softmax attention on the even layers
            types = [FULL if (i + 1) % 2 else LINEAR for i in range(n_layers)]
        if len(types) != n_layers:
            raise f.error("layer_types", f"has {len(types)} entries for {n_layers} layers")
        for t in types:
            if t not in KINDS:
                raise f.error("layer_types", f"layer type {t!r} is not supported (expected {LINEAR!r} or {FULL!r})")
        return list(types)

    def config_to_spec(self, config, *, strict=False):
        spec = super().config_to_spec(config, strict=strict)  # Mixtral's reading: every layer softmax attention
        f = Fields(config, self.model_type, self.defaults)
        L = spec.n_layers
        types = self.layer_kinds(f, L)
        data = spec.to_dict()
        (base,) = data["layers"].values()
        base = {("mixer" if k == "attention" else k): v for k, v in base.items()}
        mlp = {k: float(f.get(v, 1.0)) for k, v in MLP_ALPHAS.items()}
        att = base["mixer"]
        layers = {}
        for t in dict.fromkeys(types):
            block = {"name": "scaled_residual", **{k: float(f.get(v, 1.0)) for k, v in ALPHAS[t].items()}, **mlp}
            layer = {**base, "block": block}
            if t == LINEAR:
                layer["mixer"] = {"name": "lightning_attention", "n_heads": att["n_heads"], "head_dim": att["head_dim"],
                                  "activation": self.read_activation(f),
                                  "norm_eps": LIGHTNING_NORM_EPS, "chunk": f.get("block_size", kind=int)}
            layers[KINDS[t]] = layer
        data["layers"], data["layer_pattern"] = layers, list(pattern([KINDS[t] for t in types]))
        rotary_dim = f.get("rotary_dim", kind=int)
        if rotary_dim is not None and rotary_dim != att["head_dim"]:  # the release's partial RoPE
            data["position"] = {**{k: v for k, v in data["position"].items() if k != "rotary_fraction"},
                                "rotary_dim": rotary_dim}
        return ModelSpec.from_dict(data)

    # -- spec -> config -------------------------------------------------------------------------
    def spec_to_config(self, spec):
        n = spec.n_layers
        mixers = [spec.layer(i).mixer for i in range(n)]
        for i, m in enumerate(mixers):
            if m.name not in ("attention", "lightning_attention"):
                raise ValueError(f"minimax's layers are 'attention' or 'lightning_attention'; layer {i} is {m.name!r}")
        types = [LINEAR if m.name == "lightning_attention" else FULL for m in mixers]
        if FULL not in types:
            raise ValueError("minimax needs at least one softmax-attention layer (it holds the attention fields)")
        scales: dict[str, set] = {}
        for i in range(n):
            block = spec.layer(i).block
            if block.name != "scaled_residual":
                raise ValueError(f"minimax's layers use the 'scaled_residual' block; layer {i} uses {block.name!r}")
            for k, v in {**ALPHAS[types[i]], **MLP_ALPHAS}.items():
                scales.setdefault(v, set()).add(getattr(block, k))
        for field, values in scales.items():
            if len(values) > 1:
                raise ValueError(f"minimax has one {field} for its layers; the spec has {sorted(values)}")
        for what in ("ffn", "norm"):
            if len({repr(getattr(spec.layer(i), what)) for i in range(n)}) > 1:
                raise ValueError(f"minimax has one {what} for every layer (its config has one set of fields for it)")
        # Mixtral's writer sees the softmax-attention layers only (the lightning ones share their fields).
        data = spec.to_dict()
        data["layers"] = {"default": {**data["layers"][spec.layer_kind(types.index(FULL))], "block": {"name": "serial"}}}
        data["layer_pattern"] = ["default"]
        out = super().spec_to_config(ModelSpec.from_dict(data))
        out.update({field: values.pop() for field, values in scales.items()}, layer_types=types)
        fraction = out["rope_parameters"].pop("partial_rotary_factor", None)
        if fraction is not None:  # the release's spelling, which transformers does not read (see above)
            out["rotary_dim"] = round(fraction * out["head_dim"])
        chunks = {m.chunk for m in mixers if m.name == "lightning_attention"}
        out["block_size"] = chunks.pop() if len(chunks) == 1 else self.defaults["block_size"] if not chunks else None
        for i, m in enumerate(mixers):
            if m.name != "lightning_attention":
                continue
            if (m.n_heads, m.head_dim or spec.d_model // m.n_heads) != (out["num_attention_heads"], out["head_dim"]):
                raise ValueError(f"minimax's lightning layers have the softmax layers' heads and head_dim "
                                 f"({out['num_attention_heads']} x {out['head_dim']}); layer {i} has {m.n_heads} x {m.head_dim}")
            if activation_name(m.activation) != out[self.act_field.hf]:
                raise ValueError(f"minimax's lightning layers use the experts' activation {out[self.act_field.hf]!r} "
                                 f"({self.act_field.hf}); layer {i} uses {activation_name(m.activation)!r}")
            if m.norm_eps != LIGHTNING_NORM_EPS or m.chunk != out["block_size"]:
                raise ValueError(f"minimax's lightning layers share one block_size and have output-norm eps "
                                 f"{LIGHTNING_NORM_EPS}; layer {i} has chunk {m.chunk}, norm_eps {m.norm_eps}")
        return out


FORMATS = [MiniMax()]

"""MiniMax-M2 (``minimax_m2``): MiniMax's successor to Text-01/M1 with full attention in every layer.

No lightning attention and no alpha/beta residual: pre-norm Llama blocks whose attention is GQA with
an RMSNorm over the whole q and k projections (OLMo 2's ``proj`` QK-norm) and partial RoPE
(``rope_parameters.partial_rotary_factor``, the rotated part half-split), and a Mixtral-style MoE in
every layer whose router scores experts by a sigmoid, adds the ``e_score_correction_bias`` buffer only
to choose them, and renormalises the chosen unbiased scores: DeepSeek-V3's ``sigmoid_group`` router
with one group, and ``norm_topk_prob`` always on. Tensor names are Mixtral's
(``block_sparse_moe.gate``, ``block_sparse_moe.experts.{j}.w1/w2/w3``) plus
``block_sparse_moe.e_score_correction_bias`` and ``self_attn.q_norm`` / ``k_norm``.

Released config.json files state the partial RoPE as ``rotary_dim`` alone (64 of ``head_dim`` 128);
transformers' ``MiniMaxM2Config.convert_rope_params_to_dict`` reads it as ``partial_rotary_factor =
rotary_dim / head_dim``, below a ``partial_rotary_factor`` the config states itself (top-level or in
``rope_parameters``), and so does zoo. Saves write the factor in ``rope_parameters``.
"""

from __future__ import annotations

from zoo.checkpoints.hf.fields import merged
from zoo.checkpoints.hf.formats.llama import LAYER, TINY, LlamaStyle
from zoo.checkpoints.hf.formats.moe import MoEStyle, Mixtral
from zoo.checkpoints.hf.maps import ZOO_LAYER, rule


class MiniMaxM2(MoEStyle):
    model_type, architecture = "minimax_m2", "MiniMaxM2ForCausalLM"
    fields = LlamaStyle.fields - ("mlp_bias", "attention_bias")  # no biases anywhere
    template = merged(LlamaStyle.template, {"layer": {"mixer": {"qk_norm": "proj"}}})
    mlp, experts_key, width_key, projections = Mixtral.mlp, Mixtral.experts_key, None, Mixtral.projections
    router = "sigmoid_group"  # one group: plain top-k of the biased sigmoid scores
    norm_topk_default = None  # not a field: always renormalised
    moe_fields = MoEStyle.moe_fields + ("router_jitter_noise", "rotary_dim")
    random_buffers = ("e_score_correction_bias",)
    # MiniMaxM2Config's defaults for absent fields.
    defaults = {"vocab_size": 200064, "hidden_size": 3072, "intermediate_size": 1536, "num_hidden_layers": 62,
                "num_attention_heads": 48, "num_key_value_heads": 8, "head_dim": 128,
                "max_position_embeddings": 196608, "rms_norm_eps": 1e-6, "num_local_experts": 256,
                "num_experts_per_tok": 8, "rope_theta": 5e6}
    # GQA 4:2 with head_dim 24 != 64 / 4, half of each head rotated, 8 experts top-3, biases drawn.
    tiny = {**TINY, "num_hidden_layers": 2, "num_local_experts": 8, "num_experts_per_tok": 3,
            "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5}}

    def rules(self, spec):
        return super().rules(spec) + [rule(f"{LAYER}{self.mlp}.e_score_correction_bias", f"{ZOO_LAYER}ffn.router.bias")]

    def config_to_spec(self, config, *, strict=False):
        from zoo.checkpoints.hf.format import Fields

        f = Fields(config, self.model_type, self.defaults)
        f.expect("router_jitter_noise", (0.0, 0), "zoo's routers add no noise")
        spec = super().config_to_spec(self.with_rotary_fraction(f), strict=strict)
        return spec.with_overrides({"layers.*.ffn.norm_topk_prob": True})

    @staticmethod
    def with_rotary_fraction(f) -> dict:
        """The config with the release's ``rotary_dim`` as the ``partial_rotary_factor`` transformers
        makes of it (where the config states no factor of its own)."""
        rotary_dim = f.get("rotary_dim", kind=int)
        if rotary_dim is None:
            return f.config
        fraction = rotary_dim / f.positive("head_dim")
        config = dict(f.config)
        if isinstance(config.get("rope_parameters"), dict):
            top = config.get("partial_rotary_factor")
            config["rope_parameters"] = {"partial_rotary_factor": top if top is not None else fraction,
                                         **config["rope_parameters"]}
        else:
            config.setdefault("partial_rotary_factor", fraction)
        return config

    def spec_to_config(self, spec):
        moe = self.moe_part(spec)
        if moe is not None and not moe.norm_topk_prob:
            raise ValueError("minimax_m2 always renormalises the chosen weights (norm_topk_prob = true)")
        data = spec.with_overrides({"layers.*.ffn.norm_topk_prob": False}) if moe is not None else spec
        return super().spec_to_config(data)


FORMATS = [MiniMaxM2()]

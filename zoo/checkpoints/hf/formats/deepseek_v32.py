"""DeepSeek-V3.2 (``deepseek_v32``): DeepSeek-V3 whose attention is DeepSeek Sparse Attention, the
``dsa`` mixer (MLA plus a lightning indexer of ``index_n_heads`` heads of ``index_head_dim``
picking ``index_topk`` keys per query).

Everything else is the ``deepseek_v3`` format: transformers' V3.2 always rotates MLA's pairs and
writes them half-split (it has no ``rope_interleave``), and its layer lists ``mlp_layer_types``
(dense then sparse) and ``layer_types`` (every layer ``indexed_attention``) must say what
``first_k_dense_replace`` says. The indexer's weights are ``self_attn.indexer.{wq_b, wk, k_norm,
weights_proj}``, under the same names in zoo's mixer.
"""

from __future__ import annotations

from zoo.checkpoints.hf.format import Fields
from zoo.checkpoints.hf.formats.deepseek import LAYER, DeepseekV3
from zoo.checkpoints.hf.maps import ZOO_MIXER, rule
from zoo.core.spec import ModelSpec

INDEXER = ("wq_b.weight", "wk.weight", "k_norm.weight", "k_norm.bias", "weights_proj.weight")
INDEX_FIELDS = {"index_n_heads": 64, "index_head_dim": 128, "index_topk": 2048}  # DeepseekV32Config's defaults
DSA_ONLY = ("indexer_loss", "indexer", "index_rope_layout")  # the dsa mixer's settings MLA lacks (checked first)


class DeepseekV32(DeepseekV3):
    model_type, architecture = "deepseek_v32", "DeepseekV32ForCausalLM"
    defaults = {**DeepseekV3.defaults, **INDEX_FIELDS, "max_position_embeddings": 163840}
    extra_fields = DeepseekV3.extra_fields + tuple(INDEX_FIELDS) + ("mlp_layer_types", "layer_types")
    # index_topk 64 covers every tiny sequence (dense, transformers' parity); tests lower it.
    tiny = {**DeepseekV3.tiny, "index_n_heads": 3, "index_head_dim": 16, "index_topk": 64}

    def rules(self, spec):
        return super().rules(spec) + [rule(f"{LAYER}self_attn.indexer.{w}", f"{ZOO_MIXER}indexer.{w}")
                                      for w in INDEXER]

    def rope_layout(self, f):
        return "pairs_to_half"

    def config_to_spec(self, config, *, strict=False):
        spec = super().config_to_spec(config, strict=strict)
        f = Fields(config, self.model_type, self.defaults)
        L, first = spec.n_layers, min(f.get("first_k_dense_replace", 3), spec.n_layers)
        want = ["dense"] * first + ["sparse"] * (L - first)
        if f.get("mlp_layer_types") not in (None, want):
            raise f.error("mlp_layer_types", f"{f.get('mlp_layer_types')} is not first_k_dense_replace = {first} "
                                             "dense layers then sparse ones")
        if f.get("layer_types") not in (None, ["indexed_attention"] * L):
            raise f.error("layer_types", f"every layer of {self.model_type} is 'indexed_attention'")
        index = {k: f.get(k, kind=int) for k in INDEX_FIELDS}
        data = spec.to_dict()
        for layer in data["layers"].values():
            layer["mixer"] = {**layer["mixer"], "name": "dsa", **index}
        return ModelSpec.from_dict(data)

    def spec_to_config(self, spec):
        mixers = {repr(spec.layer(i).mixer) for i in range(spec.n_layers)}
        dsa = spec.layer(0).mixer
        if dsa.name != "dsa" or len(mixers) > 1:
            raise ValueError(f"{self.model_type} has one DeepSeek Sparse Attention ('dsa') in every layer")
        if spec.position.layout != "pairs_to_half":
            raise ValueError(f"{self.model_type} rotates with RoPE layout 'pairs_to_half'")
        if dsa.config.indexer != "full" or dsa.config.index_rope_layout != "half":
            raise ValueError(f"{self.model_type}'s every layer runs its own indexer (indexer 'full'), which rotates "
                             "half-split (index_rope_layout 'half')")
        data = spec.to_dict()
        for layer in data["layers"].values():  # the MLA it is built on, for deepseek_v3's checks and fields
            layer["mixer"] = {k: v for k, v in layer["mixer"].items() if k not in (*INDEX_FIELDS, *DSA_ONLY)}
            layer["mixer"]["name"] = "mla"
        cfg = super().spec_to_config(ModelSpec.from_dict(data))
        cfg.pop("rope_interleave")
        return {**cfg, **{k: getattr(dsa, k) for k in INDEX_FIELDS}}


FORMATS = [DeepseekV32()]

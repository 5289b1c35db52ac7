"""GLM-5 (``glm_moe_dsa``): DeepSeek-V3.2's design (MLA with DeepSeek Sparse Attention, the ``dsa``
mixer; sigmoid-routed MoE after ``first_k_dense_replace`` dense layers) under GLM's widths, and
GLM's IndexShare (arXiv:2603.12201): ``indexer_types`` says per layer whether it runs its own
indexer (``"full"``) or reuses the top-k selection of the nearest earlier full layer
(``"shared"``, the mixer's ``indexer = "shared"``).

Without ``indexer_types`` transformers derives it: from ``index_topk_pattern`` (``"F"``/``"S"`` per
layer) when given, else layer ``i`` is full when ``max(i - index_skip_topk_offset + 1, 0) %
index_topk_freq == 0`` (offset 2, freq 1 when absent: every layer full, as GLM-5 itself). A shared
layer before any full one is refused naming ``indexer_types`` (transformers would quietly run that
layer's indexer).

Everything else is read as ``deepseek_v32`` reads it, except that GLM's indexer rotates its leading
dimensions as interleaved pairs written half-split (the mixer's ``index_rope_layout =
"pairs_to_half"``, as MLA's own part; transformers reads no ``indexer_rope_interleave``). A shared
layer has no indexer weights, in transformers as in zoo.
"""

from __future__ import annotations

from zoo.checkpoints.hf.fields import Field, FieldTable, read_fields, write_fields
from zoo.checkpoints.hf.format import Fields
from zoo.checkpoints.hf.formats.deepseek_v32 import DeepseekV32
from zoo.checkpoints.hf.common import pattern
from zoo.core.spec import ModelSpec

SHARED = "_shared"  # the suffix of a layer kind whose DSA reuses an earlier layer's selection


def indexer_types_of(spec: ModelSpec) -> list[str]:
    return [spec.layer(i).mixer.config.indexer for i in range(spec.n_layers)]


# The fields GLM adds to deepseek_v32's: the IndexShare schedule. Only indexer_types is written back.
GLM_FIELDS = FieldTable([
    Field("indexer_types", None, None, kind=list, source=indexer_types_of),
    Field("index_topk_pattern", None, None),
    Field("index_topk_freq", None, 1),
    Field("index_skip_topk_offset", None, 2),
])

# GlmMoeDsaConfig's defaults for absent fields (GLM-5's own sizes).
DEFAULTS = {
    "vocab_size": 154880, "hidden_size": 6144, "intermediate_size": 12288, "moe_intermediate_size": 2048,
    "num_hidden_layers": 78, "num_attention_heads": 64, "num_key_value_heads": 64, "n_shared_experts": 1,
    "n_routed_experts": 256, "routed_scaling_factor": 2.5, "kv_lora_rank": 512, "q_lora_rank": 2048,
    "qk_rope_head_dim": 64, "v_head_dim": 256, "qk_nope_head_dim": 192, "n_group": 1, "topk_group": 1,
    "num_experts_per_tok": 8, "norm_topk_prob": True, "max_position_embeddings": 202752, "rms_norm_eps": 1e-5,
    "index_topk": 2048, "index_head_dim": 128, "index_n_heads": 32, "first_k_dense_replace": 3,
}


def schedule(f: Fields, n_layers: int) -> list[str]:
    """Each layer's indexer ("full" or "shared"), as transformers' GlmMoeDsaConfig derives it."""
    read_fields(f, GLM_FIELDS)
    v = f.values
    types, pat = v["indexer_types"], v["index_topk_pattern"]
    if types is None and pat is not None:
        key = "index_topk_pattern"
        if isinstance(pat, str) and set(pat) <= set("FS"):
            types = [{"F": "full", "S": "shared"}[c] for c in pat]
        elif isinstance(pat, list):
            types = pat
        else:
            raise f.error(key, f"must be a string of 'F' (full) and 'S' (shared) per layer, got {pat!r}")
    elif types is None:
        freq, offset = max(v["index_topk_freq"], 1), v["index_skip_topk_offset"]
        types = ["full" if max(i - offset + 1, 0) % freq == 0 else "shared" for i in range(n_layers)]
        key = "index_topk_freq"
    else:
        key = "indexer_types"
    if len(types) != n_layers or any(t not in ("full", "shared") for t in types):
        raise f.error(key, f"gives {types!r}: one of 'full' or 'shared' for each of the {n_layers} layers")
    if types[0] == "shared":
        raise f.error(key, "layer 0 is 'shared', but a shared layer reuses the top-k selection of an earlier 'full' "
                           "layer and none comes before it: make the first layer 'full'")
    return types


class GlmMoeDsa(DeepseekV32):
    model_type, architecture = "glm_moe_dsa", "GlmMoeDsaForCausalLM"
    defaults = {**DeepseekV32.defaults, **DEFAULTS}
    # deepseek_v32's with two shared layers; index_topk 64 covers every tiny sequence (tests lower it)
    tiny = {**DeepseekV32.tiny, "num_hidden_layers": 4, "indexer_types": ["full", "shared", "full", "shared"]}

    def config_to_spec(self, config, *, strict=False):
        f = Fields(config, self.model_type, self.defaults)
        types = schedule(f, f.require("num_hidden_layers"))
        # the schedule is read here; deepseek_v32 reads the rest
        spec = super().config_to_spec({k: v for k, v in config.items() if k not in GLM_FIELDS_KEYS}, strict=strict)
        data = spec.to_dict()
        for layer in data["layers"].values():
            layer["mixer"]["index_rope_layout"] = "pairs_to_half"
        kinds = [spec.layer_kind(i) + (SHARED if t == "shared" else "") for i, t in enumerate(types)]
        layers = {}
        for kind in dict.fromkeys(kinds):
            base = data["layers"][kind.removesuffix(SHARED)]
            layers[kind] = {**base, "mixer": {**base["mixer"], "indexer": "shared"}} if kind.endswith(SHARED) else base
        if spec.mtp is not None:  # the MTP module is a layer of the last layer's kind with its own indexer
            last = spec.layer_kind(spec.n_layers - 1)
            layers.setdefault(last, data["layers"][last])
            data["mtp"]["layer"] = last
        data["layers"], data["layer_pattern"] = layers, list(pattern(kinds))
        return ModelSpec.from_dict(data)

    def spec_to_config(self, spec):
        data = spec.to_dict()
        for i in range(spec.n_layers):
            if spec.layer(i).mixer.name == "dsa" and spec.layer(i).mixer.config.index_rope_layout != "pairs_to_half":
                raise ValueError(f"{self.model_type}'s indexer rotates with index_rope_layout 'pairs_to_half' "
                                 f"(layer {i} has {spec.layer(i).mixer.config.index_rope_layout!r})")
        for layer in data["layers"].values():  # to deepseek_v32, every layer has the same DSA, its own
            for key in ("indexer", "index_rope_layout"):
                layer["mixer"].pop(key, None)
        return write_fields(spec, GLM_FIELDS, super().spec_to_config(ModelSpec.from_dict(data)))


GLM_FIELDS_KEYS = {field.hf for field in GLM_FIELDS}

FORMATS = [GlmMoeDsa()]

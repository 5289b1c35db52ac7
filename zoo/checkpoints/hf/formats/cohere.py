"""Cohere's decoders: ``cohere`` (Command R) and ``cohere2`` (Command R7B, Command A).

Llama's tensor names on a parallel block: attention and the SwiGLU FFN read one LayerNorm without
a bias (``input_layernorm``, computed in float32) and add to the stream together; RoPE on
interleaved pairs (GPT-J's layout); a tied head whose logits are multiplied by ``logit_scale``.

``cohere2`` slides a window over three layers of four (``layer_types``, or the older
``sliding_window_pattern``) and gives its full-attention layers no position encoding at all: its
attention rotates only where it slides.

``cohere``'s ``use_qk_norm`` (Command R+) normalises each head's queries and keys with weights of
their own per head (a LayerNorm over head_dim with an (heads, head_dim) weight); zoo's QK-norms share
one weight across the heads, so it is refused by name.
"""

from __future__ import annotations

import copy

from zoo.checkpoints.hf.fields import Field, expect, known
from zoo.checkpoints.hf.formats._classic import layernorm_eps
from zoo.checkpoints.hf.formats.llama import TINY, LayerTypes, LlamaStyle, Ropes, every, llama_rules
from zoo.core.spec import ModelSpec

NORM = {"name": "layernorm", "bias": False}
NOPE = {"name": "nope"}


class InterleavedRopes(Ropes):
    """RoPE on interleaved pairs (2i, 2i + 1)."""

    def read(self, f, layer_type, max_pos):
        return {**super().read(f, layer_type, max_pos), "layout": "interleaved"}


def _template():
    t = copy.deepcopy(LlamaStyle.template)
    t["layer"].update(norm=NORM, block={"name": "parallel", "shared_norm": True})
    t["final_norm"] = NORM
    return t


class Cohere(LlamaStyle):
    model_type, architecture = "cohere", "CohereForCausalLM"
    fields = (LlamaStyle.fields - ("rms_norm_eps", "mlp_bias", "tie_word_embeddings")
              + [layernorm_eps("layer_norm_eps"), Field("tie_word_embeddings", "head.tied", True),
                 Field("logit_scale", "head.scale", 0.0625, float, to_spec=lambda v: None if v is None else float(v)),
                 expect("use_qk_norm", (False, None), "Command R+'s QK LayerNorm has its own weights per head, "
                                                      "which zoo's QK-norms (one weight for every head) cannot hold")])
    template = _template()
    ropes = InterleavedRopes()
    defaults = {"max_position_embeddings": 8192, "layer_norm_eps": 1e-5, "rope_theta": 500000.0}
    tiny = {**TINY, "logit_scale": 0.5, "attention_bias": True, "tie_word_embeddings": True,
            "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}}

    def rules(self, spec):
        return llama_rules({"input_layernorm": "attn_norm"})


class Cohere2(Cohere):
    model_type, architecture = "cohere2", "Cohere2ForCausalLM"
    fields = Cohere.fields - "use_qk_norm" + known("sliding_window_pattern")
    windows = LayerTypes(every(4, "sliding_window_pattern"))
    defaults = {**Cohere.defaults, "sliding_window": 4096, "rope_theta": 10000.0}
    tiny = {**Cohere.tiny, "num_hidden_layers": 4, "sliding_window": 8}

    def complete(self, f, data):
        super().complete(f, data)
        if data["n_layers"] and all("window" not in k["mixer"] for k in data["layers"].values()):
            data["position"] = NOPE  # no layer slides: none rotates
        for kind in data["layers"].values():
            if "window" not in kind["mixer"]:
                kind["position"] = NOPE  # the full-attention layers have no position encoding

    def spec_to_config(self, spec):
        for i in range(spec.n_layers):
            if (spec.position_for(i).name == "nope") != (spec.layer(i).mixer.window is None):
                raise ValueError(f"cohere2's full-attention layers have no position encoding and its sliding ones "
                                 f"rotate; layer {i} has window {spec.layer(i).mixer.window} and position "
                                 f"{spec.position_for(i).name!r}")
        data = spec.to_dict()
        rotated = next((spec.layer_kind(i) for i in range(spec.n_layers) if spec.position_for(i).name != "nope"), None)
        rope = data["layers"][rotated].get("position", data.get("position")) if rotated else \
            {"name": "rope", "theta": 10000.0, "layout": "interleaved"}
        data["position"] = rope
        for layer in data["layers"].values():
            layer.pop("position", None)
        return super().spec_to_config(ModelSpec.from_dict(data))


FORMATS = [Cohere(), Cohere2()]

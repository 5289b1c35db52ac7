"""Upcycling: a dense model turned into a mixture of experts initialised from its FFN (the
MiniCPM-MoE and Qwen1.5-MoE recipe in the lecture notes).

Every layer's FFN becomes an ``moe`` FFN whose ``n_experts`` experts are copies of it, ``top_k`` of
them chosen per token by a softmax router with the chosen weights renormalised to sum to one. The
output then equals the dense model's exactly, whatever the (randomly initialised) router chooses.
With ``shared=True`` the dense FFN becomes an always-active shared expert and the routed experts'
down projections start at zero: again the dense output, with the routed experts growing from there.
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from zoo.core.spec import ModelSpec, SpecError


# An expert's width is the moe's d_ff: the FFN's own width settings do not carry over.
WIDTH = ("d_ff", "d_ff_rule", "multiple_of", "ffn_dim_multiplier")


def upcycle_spec(spec: ModelSpec, *, n_experts: int, top_k: int, shared: bool = False) -> ModelSpec:
    """The MoE spec of a dense ``spec``: each layer kind's FFN replaced by an ``moe`` of copies of it."""
    from zoo.checkpoints.hf.sizes import ffn_size

    data = spec.to_dict()
    for kind, layer in spec.layers.items():
        ffn = layer.ffn
        if not hasattr(ffn.cls, "gated") or getattr(ffn.config, "bias", True):
            raise SpecError(f"layers.{kind}.ffn", f"{ffn.name!r} cannot be upcycled: experts are two-matrix or "
                            "gated FFNs without biases")
        i = spec.layer_pattern.index(kind)
        width = ffn_size(spec, i)
        moe: dict[str, Any] = {"name": "moe", "n_experts": n_experts, "top_k": top_k, "d_ff": width,
                               "expert": {k: v for k, v in ffn.to_dict().items() if k not in WIDTH}, "norm_topk_prob": True}
        if shared:
            moe.update(shared_d_ff=width)
        data["layers"][kind]["ffn"] = moe
    data["label"] = f"{spec.label or 'model'}-upcycled-{n_experts}x-top{top_k}"
    return ModelSpec.from_dict(data)


def upcycle(dense: Any, *, n_experts: int, top_k: int, shared: bool = False, seed: Optional[int] = None):
    """A dense model (its spec, a :class:`ModelSpec`) turned into a mixture of experts.

    Given a spec, returns the MoE spec. Given a model, returns a new MoE model: every weight but the
    FFNs' copied, each expert a copy of its layer's FFN (or, with ``shared``, the FFN as the shared
    expert and zero routed down projections), the routers freshly initialised. Trainable at once.
    """
    from zoo.model.decoder import build_model

    if isinstance(dense, ModelSpec):
        return upcycle_spec(dense, n_experts=n_experts, top_k=top_k, shared=shared)
    spec = upcycle_spec(dense.spec, n_experts=n_experts, top_k=top_k, shared=shared)
    p = next(dense.parameters())
    model = build_model(spec, device=p.device, dtype=p.dtype, seed=seed)
    source = dense.state_dict()
    target = model.state_dict()
    with torch.no_grad():
        for name, t in target.items():
            if name in source and ".ffn." not in name:
                t.copy_(source[name])
        for old, new in zip(dense.layers, model.layers):
            ffn, moe = old.ffn, new.ffn
            experts = moe.experts
            experts.w_up.copy_(ffn.up.weight)  # broadcast: every expert the same
            if experts.w_gate is not None:
                experts.w_gate.copy_(ffn.gate.weight)
            if shared:
                moe.shared.load_state_dict(ffn.state_dict())
                experts.w_down.zero_()
            else:
                experts.w_down.copy_(ffn.down.weight)
    model.train(dense.training)
    return model

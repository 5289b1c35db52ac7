"""Checkpoint layouts and weight-name rules of multi-token-prediction (MTP) modules."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional
from zoo.checkpoints.hf.maps import Rule


@dataclass(frozen=True)
class MTPLayout:
    """Where a checkpoint keeps the MTP modules: ``block`` is the prefix of depth d's block (``{n}``
    stands for ``n_layers + d``, ``{d}`` for d, 0-based; for a module of several blocks, ``{k}`` is the
    running number of the block over all depths, ``d * blocks + j``, and ``{n}`` is ``n_layers + k``),
    the other fields the names of its own tensors (``{block}`` is its first block's prefix, ``{last}``
    its last block's); ``copies``: it also stores the embedding and the head per depth."""

    block: str
    enorm: str
    hnorm: str
    eh_proj: str
    norm: str
    copies: bool


#: DeepSeek-V3: depth d is layer n_layers + d, beside copies of the embedding and the head.
DEEPSEEK = MTPLayout("model.layers.{n}.", "{block}enorm.weight", "{block}hnorm.weight", "{block}eh_proj.weight",
                     "{block}shared_head.norm.weight", copies=True)


#: Nemotron 3 (``nemotron_h``): an ``mtp.`` tree of ``mtp_layers_block_type`` layers numbered on over the
#: depths, the fusion (enorm, hnorm, eh_proj) in the first, the head's norm (``final_layernorm``) in the
#: last, as vLLM's ``nemotron_h_mtp`` names them; no copies of the embedding or head.
NEMOTRON_H = MTPLayout("mtp.layers.{k}.", "{block}enorm.weight", "{block}hnorm.weight", "{block}eh_proj.weight",
                       "{last}final_layernorm.weight", copies=False)


#: Qwen3-Next (and Qwen3.5): an ``mtp.`` tree beside the model, the same parts under other names.
QWEN3_NEXT = MTPLayout("mtp.layers.{d}.", "mtp.pre_fc_norm_embedding.weight", "mtp.pre_fc_norm_hidden.weight",
                       "mtp.fc.weight", "mtp.norm.weight", copies=False)


def mtp_rules(rules: list, spec, layout: MTPLayout = DEEPSEEK, *, hf_layer: str = "model.layers.{i}.",
              zoo_layer: str = "layers.{i}.") -> list:
    """The weight-name rules of the MTP modules, derived from a format's own per-layer ``rules``:
    depth d's block (or blocks, ``block.{j}``) under the names a main layer uses (``hf_layer`` moved to
    ``layout.block``), beside its enorm, hnorm, eh_proj and head norm (and, in DeepSeek's layout, the
    copies of the embedding, ``embed_tokens``, and of the head, ``shared_head.head``).

    Returns the rules to put *before* the format's own (so that on loading, the main embedding and
    head, read after their copies, are the ones kept). Empty when the spec has no MTP.
    """
    from zoo.checkpoints.hf.maps import Rule, Transform, rule

    # The stored copies of the embedding and head: written as copies of their own (safetensors
    # refuses two names over one storage).
    copy = Transform("copy", lambda ts, h: list(ts), lambda ts, h: [t.clone() for t in ts])
    if spec.mtp is None:
        return []
    from zoo.model.mtp import mtp_layer_kinds

    per = len(mtp_layer_kinds(spec))
    out: list[Rule] = []
    for d in range(spec.mtp.depth):
        blocks = [layout.block.format(n=spec.n_layers + d * per + j, d=d, k=d * per + j) for j in range(per)]
        hf, last = blocks[0], blocks[-1]
        z = f"mtp.layers.{d}."
        out += [rule(getattr(layout, name).format(block=hf, last=last, d=d), f"{z}{name}.weight")
                for name in ("enorm", "hnorm", "eh_proj", "norm")]
        if layout.copies:
            out += [rule(f"{hf}embed_tokens.weight", "embed.weight", copy),
                    rule(f"{hf}shared_head.head.weight", "embed.weight" if spec.head.tied else "lm_head.weight", copy)]
        for j, prefix in enumerate(blocks):
            zb = f"{z}block." if per == 1 else f"{z}block.{j}."
            for r in rules:
                if not r.per_layer or not all(n.startswith(zoo_layer) for n in r.zoo):
                    continue
                out.append(Rule(tuple(n.replace(hf_layer, prefix) for n in r.hf),
                                tuple(n.replace(zoo_layer, zb) for n in r.zoo), r.transform))
    return out


def read_mtp(f, key: str = "num_nextn_predict_layers") -> Optional[dict[str, Any]]:
    """The spec's ``mtp`` table from an HF config's count of MTP modules (``f`` a
    :class:`~zoo.checkpoints.hf.format.Fields`), or None when it is absent or 0."""
    from zoo.core.spec import MAX_MTP_DEPTH

    depth, limit = f.get(key, 0), MAX_MTP_DEPTH
    if depth < 0:
        raise f.error(key, f"must be >= 0, got {depth}")
    if depth > limit:  # each module is a layer's worth of names and rules, before the file is read
        raise f.error(key, f"{depth} is beyond zoo's limit of {limit} multi-token prediction modules "
                           "(more than any model it describes); check the value")
    return {"depth": depth} if depth else None


def without_absent_mtp(spec, fmt, names: set[str]):
    """``spec`` without its MTP modules when the checkpoint (tensor ``names``) holds none of their
    weights, as a checkpoint transformers wrote does (it drops them, keeping the config's count).
    A checkpoint that holds some of them must hold all: load_weights names the missing depth."""
    if spec.mtp is None:
        return spec
    own = {h for r in fmt.rules(spec) if any(z.startswith("mtp.layers.") for z in r.zoo) for h in r.hf}
    if own & names:
        return spec
    import dataclasses

    return dataclasses.replace(spec, mtp=None)


def missing_depth(bound: list, missing: list[str]) -> Optional[int]:
    """The first MTP depth (1-based) whose weights ``missing`` (HF names) holds, or None."""
    gone = set(missing)
    for b in bound:
        for h, z in zip(b.hf, b.zoo):
            if h in gone and z.startswith("mtp.layers."):
                return int(z.split(".")[2]) + 1
    return None

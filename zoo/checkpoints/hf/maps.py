"""Two-way weight-name maps: one table of rules per HF ``model_type``, used to load and to save.

A :class:`Rule` ties one or more HF tensor names to one or more zoo parameter names through a
named :class:`Transform` that knows both directions (``to_zoo`` and ``to_hf``), so there is never
a second, hand-written inverse. ``{i}`` in a name stands for the layer index.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Callable, Iterator, Sequence

import torch

from zoo.core.deprecations import OLD_EXPERT_NAMES, warn
from zoo.core.kinds import mixer_of

Tensors = list[torch.Tensor]


@dataclass(frozen=True)
class Heads:
    """What a transform that splits or fuses projections needs to know about a layer's heads; the
    layer's mixer reports it (``mixer.heads()``)."""

    n_heads: int
    n_kv_heads: int
    head_dim: int


@dataclass(frozen=True)
class Transform:
    """A named, invertible change between HF tensors and zoo tensors. One that ``needs_heads`` is
    given the layer's :class:`Heads`; every other one gets ``None``."""

    name: str
    to_zoo: Callable[[Tensors, Heads], Tensors]
    to_hf: Callable[[Tensors, Heads], Tensors]
    needs_heads: bool = False

    def __repr__(self) -> str:
        return self.name


IDENTITY = Transform("identity", lambda ts, h: list(ts), lambda ts, h: list(ts))

# GPT-2 stores its projections as Conv1D: (in, out) instead of nn.Linear's (out, in).
TRANSPOSE = Transform(
    "transpose",
    lambda ts, h: [t.t().contiguous() for t in ts],
    lambda ts, h: [t.t().contiguous() for t in ts],
)

# Hub MoE checkpoints store one tensor per expert (``experts.{j}.gate_proj.weight``); zoo stacks them
# into one (E, ...) tensor. Saving unbinds them again, each its own copy (safetensors refuses views
# of one storage).
STACK = Transform(
    "stack",
    lambda ts, h: [torch.stack(ts)],
    lambda ts, h: [t.clone() for t in ts[0].unbind(0)],
)


def compose(*transforms: Transform) -> Transform:
    """Apply ``transforms`` left to right when loading (and right to left when saving)."""

    def to_zoo(ts, h):
        for t in transforms:
            ts = t.to_zoo(ts, h)
        return ts

    def to_hf(ts, h):
        for t in reversed(transforms):
            ts = t.to_hf(ts, h)
        return ts

    return Transform("+".join(t.name for t in transforms), to_zoo, to_hf, any(t.needs_heads for t in transforms))


def fused_experts(n: int, transposed: bool = False) -> Transform:
    """``n`` experts' matrices stored as one ``(n * rows, cols)`` tensor (DBRX's ``experts.mlp.w1``)
    <-> zoo's stacked ``(n, rows, cols)``; ``transposed``: each expert's block is the transpose of
    zoo's matrix (DBRX's ``w2`` holds the down projections as ``(d_ff, d_model)`` blocks)."""

    def to_zoo(ts, h):  # a tensor of its own (not a view into the file's buffer), as STACK gives
        t = ts[0].reshape(n, -1, ts[0].shape[-1])
        return [t.transpose(1, 2).contiguous() if transposed else t.clone()]

    def to_hf(ts, h):
        t = ts[0].transpose(1, 2) if transposed else ts[0]
        return [t.reshape(-1, t.shape[-1]).contiguous()]

    return Transform(f"fused_experts{'_transposed' if transposed else ''}({n})", to_zoo, to_hf)


def _qkv(name: str, split, fuse) -> Transform:
    return Transform(name, lambda ts, h: split(ts[0], h), lambda ts, h: [fuse(ts, h)], needs_heads=True)


def _concat_split(t, h):
    q = h.n_heads * h.head_dim
    kv = h.n_kv_heads * h.head_dim
    return list(torch.split(t, [q, kv, kv], dim=0))


def _concat_fuse(ts, h):
    return torch.cat(ts, dim=0)


def _per_head_split(t, h):
    # rows: for each head, [q_h, k_h, v_h] (GPT-NeoX; Falcon without multi-query)
    if h.n_kv_heads != h.n_heads:
        raise ValueError("the per-head fused QKV layout needs as many kv heads as query heads")
    parts = t.reshape(h.n_heads, 3, h.head_dim, *t.shape[1:])
    return [parts[:, j].reshape(h.n_heads * h.head_dim, *t.shape[1:]).contiguous() for j in range(3)]


def _per_head_fuse(ts, h):
    rest = ts[0].shape[1:]
    parts = [x.reshape(h.n_heads, 1, h.head_dim, *rest) for x in ts]
    return torch.cat(parts, dim=1).reshape(3 * h.n_heads * h.head_dim, *rest).contiguous()


def _grouped_split(t, h):
    # rows: for each kv group, [q of the group's G heads, k, v] (Falcon's new decoder architecture)
    G = h.n_heads // h.n_kv_heads
    rest = t.shape[1:]
    parts = t.reshape(h.n_kv_heads, G + 2, h.head_dim, *rest)
    q = parts[:, :G].reshape(h.n_heads * h.head_dim, *rest)
    k = parts[:, G].reshape(h.n_kv_heads * h.head_dim, *rest)
    v = parts[:, G + 1].reshape(h.n_kv_heads * h.head_dim, *rest)
    return [q.contiguous(), k.contiguous(), v.contiguous()]


def _grouped_fuse(ts, h):
    q, k, v = ts
    G = h.n_heads // h.n_kv_heads
    rest = q.shape[1:]
    q = q.reshape(h.n_kv_heads, G, h.head_dim, *rest)
    k = k.reshape(h.n_kv_heads, 1, h.head_dim, *rest)
    v = v.reshape(h.n_kv_heads, 1, h.head_dim, *rest)
    return torch.cat([q, k, v], dim=1).reshape(-1, *rest).contiguous()


#: q, k and v stacked one after the other (GPT-2's c_attn, Falcon-7B's multi-query layout).
FUSED_QKV = _qkv("fused_qkv", _concat_split, _concat_fuse)
#: q, k, v interleaved head by head (GPT-NeoX, Falcon with one kv head per query head).
FUSED_QKV_PER_HEAD = _qkv("fused_qkv_per_head", _per_head_split, _per_head_fuse)
#: per kv group: the group's query heads, then its key and value head (Falcon 40B/180B).
FUSED_QKV_GROUPED = _qkv("fused_qkv_grouped", _grouped_split, _grouped_fuse)


#: zoo's side of the weight names of layer ``{i}``, and of its mixer: every format names them from these.
ZOO_LAYER = "layers.{i}."
ZOO_MIXER = ZOO_LAYER + "mixer."
# zoo 0.1 and 0.2 stored the mixer as ``attention``: a (plugin) format may still name it so. Renamed only where
# the model has the new name (a plugin's own block may still own an ``attention``).
_OLD_MIXER = re.compile(r"^((?:mtp\.)?layers\.(?:\{i\}|\d+)\.(?:block\.)?)attention\.")
OLD_MIXER_NAMES = "zoo-side parameter names layers.{i}.attention.*"


def current_name(name: str) -> str:
    """``name`` with zoo 0.2's ``layers.{i}.attention.`` spelt ``layers.{i}.mixer.``."""
    return _OLD_MIXER.sub(r"\1mixer.", name)


# zoo 0.2 stored an moe FFN's stacked experts on the FFN (``layers.{i}.ffn.w_up``); they are now its
# ``experts`` module's. Renamed only where the model has the new name (a plugin FFN may own a ``w_up``).
_OLD_EXPERTS = re.compile(r"^((?:mtp\.)?layers\.(?:\{i\}|\d+)\.(?:block\.)?ffn\.)(w_gate|w_up|w_down)$")


def moved_expert_name(name: str) -> str:
    """``layers.{i}.ffn.w_up`` (zoo 0.2's stacked experts) spelt ``layers.{i}.ffn.experts.w_up``;
    any other name as it is."""
    return _OLD_EXPERTS.sub(r"\1experts.\2", name)


_NEW_MIXER = re.compile(r"^((?:mtp\.)?layers\.\d+\.(?:block\.)?)mixer\.")
_NEW_EXPERTS = re.compile(r"^((?:mtp\.)?layers\.\d+\.(?:block\.)?ffn\.)experts\.(w_gate|w_up|w_down)$")


def earlier_names(name: str) -> list[str]:
    """The names earlier zoo releases stored the parameter ``name`` under (zoo 0.2's
    ``layers.{i}.attention.*``, zoo 0.2's ``layers.{i}.ffn.w_up``), if it had others."""
    out = [_NEW_MIXER.sub(r"\1attention.", name), _NEW_EXPERTS.sub(r"\1\2", name)]
    return [n for n in dict.fromkeys(out) if n != name]


@dataclass(frozen=True)
class Rule:
    """HF name(s) <-> zoo name(s), through ``transform``. Names may contain ``{i}`` (layer index)."""

    hf: tuple[str, ...]
    zoo: tuple[str, ...]
    transform: Transform = IDENTITY

    @property
    def per_layer(self) -> bool:
        return any("{i}" in n for n in self.hf + self.zoo)


def rule(hf: str | Sequence[str], zoo: str | Sequence[str], transform: Transform = IDENTITY) -> Rule:
    as_tuple = lambda x: (x,) if isinstance(x, str) else tuple(x)  # noqa: E731
    return Rule(as_tuple(hf), as_tuple(zoo), transform)


@dataclass(frozen=True)
class Bound:
    """A rule instantiated for one layer (or for the whole model)."""

    hf: tuple[str, ...]
    zoo: tuple[str, ...]
    transform: Transform
    heads: Heads | None


def bind(rules: Sequence[Rule], model) -> Iterator[Bound]:
    """Instantiate ``rules`` for ``model``: each per-layer rule once per layer, and only the rules
    whose zoo parameters the model has (a bias rule applies only where the model has biases)."""
    names = set(model.state_dict(keep_vars=True))
    for r in rules:
        layers = range(len(model.layers)) if r.per_layer else [None]
        for i in layers:
            fmt = (lambda n: n.replace("{i}", str(i))) if i is not None else (lambda n: n)
            zoo_names = tuple(fmt(n) for n in r.zoo)
            present = [n in names for n in zoo_names]
            if not all(present):
                zoo_names, present = _as_model_names(zoo_names, present, names)
            if not any(present):
                continue
            if not all(present):
                missing = [n for n, p in zip(zoo_names, present) if not p]
                raise ValueError(f"rule {r.hf} -> {r.zoo}: the model lacks {missing}")
            heads = None
            if r.transform.needs_heads:
                mixer = mixer_of(model.layers[i if i is not None else 0])
                found = mixer.heads()
                if found is None:
                    raise ValueError(f"rule {r.hf} -> {r.zoo}: transform {r.transform.name} needs the layer's heads, "
                                     f"but its mixer {type(mixer).__name__} has no heads() method")
                heads = Heads(*found)
            yield Bound(tuple(fmt(n) for n in r.hf), zoo_names, r.transform, heads)


def _as_model_names(zoo_names: tuple[str, ...], present: list[bool], names: set[str]):
    """A rule's zoo names, spelt as the model has them: a (plugin) format written against zoo 0.2's
    ``layers.{i}.attention.*`` or zoo 0.2's MoE ``layers.{i}.ffn.w_up`` loads and saves, and warns, where
    the model has the new names instead; a model that has the old names (a plugin's own block or FFN
    that owns them) keeps them."""
    mixer = tuple(current_name(n) for n in zoo_names)
    both = tuple(moved_expert_name(n) for n in mixer)
    if both == zoo_names or not all(n in names for n in both):
        return zoo_names, present
    if mixer != zoo_names:
        warn(OLD_MIXER_NAMES, stacklevel=4)
    if both != mixer:
        warn(OLD_EXPERT_NAMES, stacklevel=4)
    return both, [True] * len(both)


# -- rule builders shared by the formats --------------------------------------------------------

def linear(hf: str, zoo: str, transform: Transform = IDENTITY, weights: Sequence[str] = ("weight", "bias")) -> list[Rule]:
    """``hf.weight`` -> ``zoo.weight`` and ``hf.bias`` -> ``zoo.bias`` (a bias rule applies only where
    the model has one)."""
    return [rule(f"{hf}.{w}", f"{zoo}.{w}", transform) for w in weights]


def llama_attention(prefix: str, zoo: str = ZOO_MIXER) -> list[Rule]:
    """Llama's ``self_attn``: q, k, v and o projections (weights and biases) and the QK-norm weights."""
    return ([r for p in "qkvo" for r in linear(f"{prefix}{p}_proj", f"{zoo}{p}_proj")]
            + [rule(f"{prefix}{p}_norm.weight", f"{zoo}{p}_norm.weight") for p in "qk"])


def gated_mlp(prefix: str, zoo: str = ZOO_LAYER + "ffn.", weights: Sequence[str] = ("weight", "bias")) -> list[Rule]:
    """A gated MLP stored as ``gate_proj``, ``up_proj``, ``down_proj`` (Llama's ``mlp``, a shared expert)."""
    return [r for hf, z in (("gate_proj", "gate"), ("up_proj", "up"), ("down_proj", "down"))
            for r in linear(f"{prefix}{hf}", f"{zoo}{z}", weights=weights)]


#: zoo's stacked expert tensors (an moe FFN's ``experts.*``) -> the HF name of each expert's projection
#: (Llama-layout MoEs).
EXPERT_PROJECTIONS = {"w_gate": "gate_proj", "w_up": "up_proj", "w_down": "down_proj"}


def stacked_experts(prefix: str, n: int, projections: dict[str, str] = EXPERT_PROJECTIONS,
                    zoo: str = ZOO_LAYER + "ffn.experts.") -> list[Rule]:
    """``n`` experts stored one tensor per expert (``{prefix}{j}.gate_proj.weight``) <-> zoo's stacked
    ``(n, ...)`` tensors, through :data:`STACK`."""
    return [rule([f"{prefix}{j}.{hf}.weight" for j in range(n)], f"{zoo}{z}", STACK) for z, hf in projections.items()]


def layer_norms(prefix: str, names: dict[str, str], weights: Sequence[str] = ("weight",)) -> list[Rule]:
    """A layer's norms: HF module name -> zoo norm name (``input_layernorm`` -> ``attn_norm``)."""
    return [r for hf, z in names.items() for r in linear(f"{prefix}{hf}", f"{ZOO_LAYER}{z}", weights=weights)]


def embed_and_head(embed: str = "model.embed_tokens.weight", final_norm: str = "model.norm.weight",
                   head: str = "lm_head.weight") -> list[Rule]:
    """The token embedding, the final norm and the (untied) output head."""
    return [rule(embed, "embed.weight"), rule(final_norm, "final_norm.weight"), rule(head, "lm_head.weight")]

"""Position encodings: sinusoidal and learned absolute, RoPE (half-split or interleaved pairs,
partial rotary, any registered frequency scaling), and NoPE."""

from dataclasses import dataclass
from typing import ClassVar, Literal, Optional

import torch
from torch import nn

from zoo.core import kernels
from zoo.core.kinds import PositionEncoding, rotary_dim_of
from zoo.core.registry import register
from zoo.core.spec import MAX_HEAD_DIM, Part, SpecError, part_field, positive

from zoo.components.positions.rope_scaling import default_inv_freq


@register("position", "nope")
class NoPE(PositionEncoding):
    """No position information beyond the causal mask."""

    @dataclass(frozen=True)
    class Config:
        pass

    def __init__(self, cfg=None, *, spec=None, layer=None):
        super().__init__()


def sequence_slice(module, rows: torch.Tensor) -> torch.Tensor:
    """``rows`` (B, T, ...) for the whole sequence, or under tensor parallelism (``module._tp_mesh``, set by
    its ``parallelize``) this process's slice of it, the one its embeddings hold (the slice at offset
    ``rank * T / tp``). A tensor with parameters behind it gets its gradient summed over the processes,
    each of which uses only its slice."""
    mesh = getattr(module, "_tp_mesh", None)
    if mesh is None:
        return rows
    from zoo.core.parallel import grad_summed

    if rows.requires_grad:
        rows = grad_summed(rows, mesh)
    return rows.chunk(mesh.size(), dim=1)[mesh.get_local_rank()]


class Absolute(PositionEncoding):
    """What the absolute encodings share: their tensor-parallel plan. The vectors they add are made for
    the whole sequence, and each process adds its slice to the sequence slice of the embeddings it holds
    (:func:`sequence_slice`)."""

    applies_to = "embedding"

    # -- what this part states about itself ---------------------------------------------------------
    def parallelize(self, tp_mesh, **kw) -> None:
        self._tp_mesh = tp_mesh


@register("position", "sinusoidal")
class Sinusoidal(Absolute):
    """The 2017 encoding: ``PE[p, 2i] = sin(p / base^(2i/d))``, ``PE[p, 2i+1] = cos(...)``, added to embeddings."""

    applies_to = "embedding"

    @dataclass(frozen=True)
    class Config:
        base: float = 10000.0

    def __init__(self, cfg, *, spec, layer=None):
        super().__init__()
        self.base, self.d = cfg.base, spec.d_model

    def embed(self, position_ids, dtype):
        half = torch.arange(0, self.d, 2, device=position_ids.device, dtype=torch.float32)
        angles = position_ids.float()[..., None] / (self.base ** (half / self.d))
        pe = torch.zeros(*position_ids.shape, self.d, device=position_ids.device)
        pe[..., 0::2] = torch.sin(angles)
        pe[..., 1::2] = torch.cos(angles[..., : self.d // 2])
        return sequence_slice(self, pe.to(dtype))


@register("position", "learned")
class Learned(Absolute):
    """A learned vector per absolute position (GPT-2/3), added to embeddings."""

    applies_to = "embedding"

    @dataclass(frozen=True)
    class Config:
        pass

    def __init__(self, cfg, *, spec, layer=None):
        super().__init__()
        self.table = nn.Embedding(spec.max_seq_len, spec.d_model)

    def embed(self, position_ids, dtype):
        return sequence_slice(self, self.table(position_ids).to(dtype))

    # -- what this part states about itself ---------------------------------------------------------
    @classmethod
    def max_positions(cls, config, spec):
        return spec.max_seq_len  # one row per position


@register("position", "rope")
class RoPE(PositionEncoding):
    """Rotary embeddings: rotate each (query, key) pair of dimensions by ``position * freq``, so
    that scores depend only on relative position.

    ``layout``: ``half`` pairs dimension i with i + d/2 (Llama, NeoX); ``interleaved`` pairs 2i
    with 2i+1 (GPT-J); ``pairs_to_half`` rotates the pairs (2i, 2i+1) and writes them out half-split,
    the evens' results first (DeepSeek-V3's ``rope_interleave``: the same as ``half`` on the vector
    with its even dimensions moved to the front). ``rotary_fraction`` (or ``rotary_dim``) rotates only the leading dims.
    """

    applies_to = "qk"
    kernel: ClassVar[str] = "rope"
    backends: ClassVar[tuple] = ("triton", "torch")

    @dataclass(frozen=True)
    class Config:
        theta: float = 10000.0
        layout: Literal["half", "interleaved", "pairs_to_half"] = "half"
        rotary_fraction: float = 1.0
        rotary_dim: Optional[int] = None
        scaling: Optional[Part] = part_field("rope_scaling", None)

        def check(self):
            positive("theta", self.theta, allow_none=False)
            if not 0.0 < self.rotary_fraction <= 1.0:
                raise SpecError("rotary_fraction", f"must be in (0, 1], got {self.rotary_fraction}")
            if self.rotary_dim is not None and (self.rotary_dim <= 0 or self.rotary_dim % 2):
                raise SpecError("rotary_dim", f"must be a positive even number, got {self.rotary_dim}")

    @staticmethod
    def rotary_dim_for(cfg, head_dim: int) -> int:
        return cfg.rotary_dim if cfg.rotary_dim is not None else int(head_dim * cfg.rotary_fraction)

    def __init__(self, cfg, *, spec, layer):
        super().__init__()
        self.cfg = cfg
        self.head_dim = rotary_dim_of(layer, spec.d_model)  # the width of the vectors it rotates
        if self.head_dim is None:
            raise ValueError(f"RoPE was built for a layer whose mixer ({layer.mixer.name!r}) takes no rotation")
        self.dim = self.rotary_dim_for(cfg, self.head_dim)
        self.scaling = cfg.scaling.build(dim=self.dim, theta=cfg.theta) if cfg.scaling is not None else None
        # Frequencies that depend on the sequence length (dynamic NTK) are recomputed per forward.
        self._static = None if getattr(self.scaling, "dynamic", False) else self._frequencies(None)

    def _frequencies(self, seq_len):
        if self.scaling is None:
            return default_inv_freq(self.dim, self.cfg.theta), 1.0
        return self.scaling.frequencies(seq_len)

    def prepare(self, position_ids, dtype):
        if self._static is not None:
            inv_freq, factor = self._static
        else:
            inv_freq, factor = self._frequencies(int(position_ids.max()) + 1)
        freqs = position_ids.float()[..., None] * inv_freq.to(position_ids.device)  # (B, T, dim/2)
        if self.cfg.layout != "interleaved":
            emb = torch.cat([freqs, freqs], dim=-1)
        else:
            emb = torch.repeat_interleave(freqs, 2, dim=-1)
        cos, sin = emb.cos() * factor, emb.sin() * factor
        return cos[:, None].to(dtype), sin[:, None].to(dtype)  # (B, 1, T, dim)

    def _rotate(self, x, cos, sin):
        rot, rest = x[..., : self.dim], x[..., self.dim :]
        if self.cfg.layout != "interleaved":
            x1, x2 = rot.chunk(2, dim=-1)
            turned = torch.cat([-x2, x1], dim=-1)
        else:
            turned = torch.stack([-rot[..., 1::2], rot[..., 0::2]], dim=-1).flatten(-2)
        out = rot * cos + turned * sin
        return torch.cat([out, rest], dim=-1) if rest.shape[-1] else out

    def _evens_first(self, x):
        """The rotated dimensions with the even ones first, then the odd ones (the rest kept)."""
        rot = x[..., : self.dim]
        out = torch.cat([rot[..., 0::2], rot[..., 1::2]], dim=-1)
        return torch.cat([out, x[..., self.dim :]], dim=-1) if x.shape[-1] > self.dim else out

    def pairs(self, state):
        """The cosine and sine of each rotated pair's angle, (B, 1, T, dim/2), whatever the layout:
        for a part that rotates vectors of its own with these angles (DSA's indexer pairs its dims
        half-split while DeepSeek's attention pairs them interleaved)."""
        cos, sin = state
        if self.cfg.layout != "interleaved":
            return cos[..., : self.dim // 2], sin[..., : self.dim // 2]
        return cos[..., 0::2], sin[..., 0::2]

    def rotate(self, q, k, state):
        if self.cfg.layout == "pairs_to_half":
            q, k = self._evens_first(q), self._evens_first(k)
        fast = kernels.fast(self, q)
        if fast is not None:
            return fast(self, q, k, state)
        cos, sin = state
        return self._rotate(q, cos, sin), self._rotate(k, cos, sin)

    # -- what this part states about itself ---------------------------------------------------------
    @classmethod
    def shrink(cls, cfg, *, head_dim: int, **sizes):
        """A fixed ``rotary_dim`` stays partial in a tiny copy: half of the tiny head (so that some
        channels are rotated and some passed, as in the model); a fraction needs no change."""
        return {"rotary_dim": max(2, head_dim // 4 * 2)} if cfg.rotary_dim is not None else {}

    @classmethod
    def check_in_model(cls, cfg, *, spec, layer):
        hd = rotary_dim_of(layer, spec.d_model)
        if hd is None:  # this layer's mixer takes no rotation
            return
        rd = cls.rotary_dim_for(cfg, hd)
        if rd > MAX_HEAD_DIM:  # its frequency table is built on the CPU, even for a model on meta
            raise SpecError("rotary_dim", f"{rd} (of head_dim {hd}) is beyond zoo's limit of {MAX_HEAD_DIM:,} "
                                          "(larger than any model it describes); check the head_dim")
        if rd % 2 or rd <= 0:
            raise SpecError("rotary_fraction", f"gives an odd or empty rotary dimension {rd} of head_dim {hd}")
        if rd > hd:
            raise SpecError("rotary_dim", f"{rd} exceeds head_dim {hd}")

"""Assemble a decoder-only language model from a :class:`~zoo.core.spec.ModelSpec`: build, forward, loss.

Every part is looked up in the registry by the name the spec gives; this module knows no
specific norm, attention or family. Data flows: ids -> embeddings (+ absolute positions)
-> blocks -> final norm -> head (+ soft-cap) -> logits. The seeded initialisation is in
:mod:`zoo.model.init`, the tensor- and expert-parallel plans in :mod:`zoo.model.parallel`, the
forward context and the decode state in :mod:`zoo.model.context`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Mapping, Optional

import torch
from torch import nn

from zoo.core import deprecations as _deprecations
from zoo.core import kinds as _kinds
from zoo.core import kernels as _kernels
from zoo.core import precision as _precision
from zoo.core import registry as _registry
from zoo.core.context import ForwardContext
from zoo.core.kinds import PositionEncoding, PositionState, rotary_dim_of
from zoo.core.spec import ModelSpec
from zoo.core.state import DecodeState
from zoo.model import context as _context
from zoo.model import init as _init
from zoo.model import parallel as _parallel
from zoo.model.loss import LossOutput, lm_loss, vocab_parallel_lm_loss
from zoo.model.mtp import MTP


@dataclass
class CausalLMOutput:
    """What ``model(ids, return_dict=True)`` returns: the fields of transformers' ``CausalLMOutput``
    that zoo computes, plus the auxiliary losses and metrics the parts added (with ``labels``)."""

    logits: torch.Tensor
    loss: Optional[torch.Tensor] = None
    hidden_states: Optional[tuple[torch.Tensor, ...]] = None
    aux: dict[str, torch.Tensor] = field(default_factory=dict)
    metrics: dict[str, torch.Tensor] = field(default_factory=dict)

    def __getitem__(self, key):
        """``out["logits"]``, and ``out[0]`` over (loss, logits, hidden_states) less the unset ones,
        as transformers' outputs allow."""
        if isinstance(key, str):
            return getattr(self, key)
        return tuple(v for v in (self.loss, self.logits, self.hidden_states) if v is not None)[key]


class Decoder(_kinds.Kernels, nn.Module):
    """A decoder-only language model built from a spec."""

    # The loss (head + soft-cap + cross-entropy + z-loss) has a fused, chunked fast path.
    kernel = "loss"
    kernel_on_shards = None  # the fused loss takes no DTensor (zoo.core.kernels.fast)
    backends = ("triton", "torch")
    # Where the weights came from, set by zoo.from_pretrained: the HF model_type, and the config
    # fields a save carries over. None and empty for a model built from a recipe.
    checkpoint_format: Optional[str] = None
    hf_config: Mapping[str, Any] = MappingProxyType({})
    # The directory or GGUF file the weights were read from (its tokenizer is the model's); None when built.
    source: Optional[Any] = None

    def __init__(self, spec: ModelSpec):
        super().__init__()
        self.spec = spec
        d = spec.d_model
        rows = spec.embedding.padded_vocab_size or spec.vocab_size
        self.embed = nn.Embedding(rows, d)
        # One position module per distinct position spec and rotation width: Gemma 3 has a local and
        # a global RoPE; two head widths get a RoPE each; a mixer that takes no rotation gets none.
        self.positions = nn.ModuleDict()
        self._pos_key: list[Optional[str]] = []
        keys: dict[object, str] = {}
        for i in range(spec.n_layers):
            part, layer = spec.position_for(i), spec.layer(i)
            dim = rotary_dim_of(layer, d) if part.cls.applies_to == "qk" else None
            if part.cls.applies_to == "qk" and dim is None:
                self._pos_key.append(None)
                continue
            key = (repr(part), dim)
            if key not in keys:
                keys[key] = str(len(keys))
                self.positions[keys[key]] = part.build(spec=spec, layer=layer)
            self._pos_key.append(keys[key])
        self.layers = nn.ModuleList(
            spec.layer(i).block.build(spec=spec, layer=spec.layer(i), index=i) for i in range(spec.n_layers)
        )
        self.final_norm = spec.final_norm.build(dim=d) if spec.final_norm is not None else None
        self.lm_head = None if spec.head.tied else nn.Linear(d, rows, bias=spec.head.bias)
        if spec.head.tied and spec.head.bias:
            self.head_bias = nn.Parameter(torch.zeros(rows))
        else:
            self.register_parameter("head_bias", None)
        # Multi-token prediction modules (zoo/model/mtp.py), when the spec asks for them.
        self.mtp = MTP(spec) if spec.mtp is not None else None
        self.drop = nn.Dropout(spec.dropout)
        self._softcap = _registry.get("stability", "softcap")  # the one soft-cap (zoo/components/stability.py)

    # -- initialisation (zoo/model/init.py) and the parallel plans (zoo/model/parallel.py) ---------
    init_weights = _init.init_weights
    parallelize = _parallel.parallelize
    parallelize_experts = _parallel.parallelize_experts
    _local_logits = _parallel.local_logits

    # -- decoding ---------------------------------------------------------------------------------
    def _apply(self, fn, recurse=True):
        # .to(dtype), .half(), .bfloat16(): tensors a part declares float32 stay float32 (zoo/core/precision.py)
        return _precision.apply_keeping_fp32(self, super()._apply, fn, recurse)

    # the decode state and the forward context (zoo/model/context.py)
    new_state = _context.new_state
    context = _context.context

    # -- forward ----------------------------------------------------------------------------------
    def hidden_states(
        self,
        input_ids: torch.Tensor,
        attention_mask: Optional[torch.Tensor] = None,
        position_ids: Optional[torch.Tensor] = None,
        state: Optional[DecodeState] = None,
        output_hidden_states: bool = False,
        *,
        cache: Optional[DecodeState] = None,
        document_ids: Optional[torch.Tensor] = None,
    ):
        """Final hidden states (before the head), and every layer's output if asked. ``cache`` is the
        old name of ``state``."""
        if cache is not None:
            _deprecations.warn("the cache= keyword")
        ctx = self.context(input_ids, attention_mask, position_ids, state if state is not None else cache, document_ids)
        return self.run_layers(input_ids, ctx, output_hidden_states)

    def run_layers(self, input_ids: torch.Tensor, ctx: ForwardContext, output_hidden_states: bool = False):
        """The layers' pass for a context already built (slots, positions, masks, decode state);
        free of data-dependent Python branches, so a compiled decode step can trace it (zoo.inference.compiled)."""
        position_ids = ctx.position_ids
        x = self.embed_tokens(input_ids)
        states: dict[Optional[str], Optional[PositionState]] = {None: None}
        for key, module in self.positions.items():
            pos: PositionEncoding = module
            absolute = pos.embed(position_ids, x.dtype)
            if absolute is not None:
                x = x + absolute
            states[key] = PositionState(pos, pos.prepare(position_ids, x.dtype))
        x = self.drop(x)
        hidden = [x] if output_hidden_states else None
        for i, layer in enumerate(self.layers):
            x = layer(x, ctx, states[self._pos_key[i]])
            if hidden is not None:
                hidden.append(x)
        ctx.finish()
        if self.final_norm is not None:
            x = self.final_norm(x)
        return (x, hidden) if output_hidden_states else x

    def hidden_states_in(self, *args: Any, **kw: Any):
        """The name of :meth:`run_layers` before mixers (deprecated)."""
        _deprecations.warn("Decoder.hidden_states_in")
        return self.run_layers(*args, **kw)

    def embed_tokens(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The token embeddings (scaled where the spec says), without absolute positions."""
        x = self.embed(input_ids)
        emb = self.spec.embedding
        factor = emb.factor(self.spec.d_model)
        if factor is not None:  # rounded to scale_dtype (default: the activation dtype), then applied in x's dtype
            rounded = torch.tensor(factor, dtype=getattr(torch, emb.scale_dtype) if emb.scale_dtype else x.dtype)
            x = x * rounded.to(x.dtype)
        return x

    def position_state(self, position_ids: torch.Tensor, dtype: torch.dtype, layer: int) -> Optional[PositionState]:
        """What layer ``layer``'s mixer gets from its position encoding for ``position_ids`` (for a
        block run outside the layer stack, such as a multi-token prediction module)."""
        key = self._pos_key[layer]
        if key is None:
            return None
        pos: PositionEncoding = self.positions[key]
        return PositionState(pos, pos.prepare(position_ids, dtype))

    def head(self) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """The output head's (weight, bias): the embedding matrix when tied. Rows beyond the
        vocabulary (padding) are included."""
        if self.lm_head is None:
            return self.embed.weight, self.head_bias
        return self.lm_head.weight, self.lm_head.bias

    def kernel_tensors(self) -> tuple:
        """The fused loss reads the head whole: sharded over tensor-parallel processes, it steps aside."""
        return tuple(t for t in self.head() if t is not None)

    def logits_from_hidden(self, x: torch.Tensor) -> torch.Tensor:
        if self.lm_head is not None:
            logits = self.lm_head(x)  # called as a module, so that a plan's hooks on it run (tensor parallelism)
        else:
            weight, bias = self.head()
            logits = _parallel.tied_logits(x, weight, bias)
        if self.spec.embedding.padded_vocab_size:
            logits = logits[..., : self.spec.vocab_size]
        return self._head_scaled(logits)

    def _head_scaled(self, logits: torch.Tensor) -> torch.Tensor:
        """The head's multiplier (Grok-1's output multiplier) and soft-cap, on the head's raw logits."""
        if self.spec.head.scale is not None:
            logits = logits * self.spec.head.scale
        if self.spec.head.softcap is not None:
            logits = self._softcap(logits, self.spec.head.softcap)
        return logits

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: Optional[torch.Tensor] = None,
        position_ids: Optional[torch.Tensor] = None,
        state: Optional[DecodeState] = None,
        *,
        labels: Optional[torch.Tensor] = None,
        cache: Optional[DecodeState] = None,
        return_dict: bool = False,
        output_hidden_states: bool = False,
        document_ids: Optional[torch.Tensor] = None,
    ):
        """Logits of shape (batch, seq, vocab); with ``labels``, the :meth:`loss` instead (so a
        wrapper that only sees ``forward`` — DDP, FSDP — still gets the fused loss path).
        ``state`` (``cache`` is its old name) continues a decode state.

        ``return_dict=True`` answers as a transformers causal LM does: a :class:`CausalLMOutput`
        with ``.logits``, ``.loss`` (with ``labels``, unshifted as in transformers) and, with
        ``output_hidden_states=True``, ``.hidden_states`` (the embeddings, then each layer's output,
        the last one after the final norm). Without it the return value is what it always was.
        ``document_ids`` (B, T): the packed documents of each row (see :meth:`context`)."""
        if cache is not None:
            _deprecations.warn("the cache= keyword")
        state = state if state is not None else cache
        if not return_dict:
            if output_hidden_states:
                raise ValueError("output_hidden_states=True needs return_dict=True (or call model.hidden_states)")
            if labels is not None:
                return self.loss(input_ids, labels, attention_mask, document_ids=document_ids)
            return self.logits_from_hidden(self.hidden_states(input_ids, attention_mask, position_ids, state,
                                                              document_ids=document_ids))
        if labels is not None:
            if state is not None or position_ids is not None or output_hidden_states:
                raise ValueError("labels: the loss is computed over whole sequences; pass no state, position_ids "
                                 "or output_hidden_states with labels")
            out = self.loss(input_ids, labels, attention_mask, return_logits=True, document_ids=document_ids)
            return CausalLMOutput(logits=out.logits, loss=out.loss, aux=out.aux, metrics=out.metrics)
        final, hidden = self.hidden_states(input_ids, attention_mask, position_ids, state, output_hidden_states=True,
                                           document_ids=document_ids)
        hidden = tuple(hidden[:-1]) + (final,) if output_hidden_states else None
        return CausalLMOutput(logits=self.logits_from_hidden(final), hidden_states=hidden)

    def loss(
        self,
        input_ids: torch.Tensor,
        labels: Optional[torch.Tensor] = None,
        attention_mask: Optional[torch.Tensor] = None,
        *,
        z_loss: Optional[float] = None,
        return_logits: bool = False,
        document_ids: Optional[torch.Tensor] = None,
    ) -> LossOutput:
        """The LM loss in one call: next-token cross-entropy, plus z-loss (coefficient from the spec
        unless given), plus each auxiliary loss a part added during the forward, times its weight.
        ``labels`` default to ``input_ids``; padding (mask 0) and labels of -100 are ignored.
        ``document_ids``: packed documents (see :meth:`context`)."""
        ctx = self.context(input_ids, attention_mask, document_ids=document_ids)
        hidden = self.run_layers(input_ids, ctx)
        labels = input_ids if labels is None else labels
        if attention_mask is not None:
            labels = labels.masked_fill(~attention_mask.bool(), -100)
        z_loss = self.spec.z_loss if z_loss is None else z_loss
        parallel = getattr(self, "_tp", 1) > 1 and not return_logits
        fused = None if return_logits or parallel else _kernels.fast(self, hidden)
        if parallel:  # vocabulary-parallel: the logits stay sharded
            logits, start, mesh = self._local_logits(hidden)
            out = vocab_parallel_lm_loss(logits[:, :-1], labels[:, 1:], start=start, tp_mesh=mesh, z_loss=z_loss)
        elif fused is not None:  # never materialises the logits
            out = LossOutput(*fused(self, hidden[:, :-1], labels[:, 1:], z_loss=z_loss))
        else:
            logits = self.logits_from_hidden(hidden)
            out = lm_loss(logits[:, :-1], labels[:, 1:], z_loss=z_loss)
            if return_logits:
                out.logits = logits
        if self.mtp is not None:
            self.mtp.add_losses(self, hidden, input_ids, labels, attention_mask, ctx)
        aux = ctx.aux_total()
        if aux is not None:
            out.loss = out.loss + aux
        out.aux, out.aux_weights, out.metrics = ctx.aux, ctx.aux_weights, ctx.metrics
        return out

    def num_parameters(self, *, exclude_embeddings: bool = False, mtp: bool = False) -> int:
        """Parameters of the model, each counted once; the multi-token prediction modules only with
        ``mtp=True`` (the main model is what transformers builds and vendors count: DeepSeek-V3's
        671B, beside 14B of MTP)."""
        seen: set[int] = set()
        total = 0
        for name, p in self.named_parameters():
            if id(p) in seen or (name.startswith("mtp.") and not mtp):
                continue
            seen.add(id(p))
            if exclude_embeddings and (p is self.embed.weight or (self.lm_head is not None and p is self.lm_head.weight)):
                continue
            if exclude_embeddings and name.startswith("positions."):
                continue
            total += p.numel()
        return total

    def generate(self, input_ids, max_new_tokens: int = 32, **kwargs):
        """Deprecated: ``zoo.generate(model, ...)``. The decoding loop is above the model (it imports
        the model, not the reverse): the deprecation table hands the call on."""
        return _deprecations.moved_call("Decoder.generate(...)")(self, input_ids, max_new_tokens, **kwargs)



def build_model(
    spec: ModelSpec,
    *,
    device: Optional[torch.device | str] = None,
    dtype: Optional[torch.dtype] = None,
    seed: Optional[int] = None,
) -> Decoder:
    """Build on the meta device (no allocation), then materialise on ``device`` and initialise."""
    with torch.device("meta"), _init.no_default_init():
        model = Decoder(spec)
    if dtype is not None:
        model = model.to(dtype)
    device = torch.device(device) if device is not None else torch.device("cpu")
    if device.type != "meta":
        model = model.to_empty(device=device)
        model.init_weights(seed=seed)
    return model

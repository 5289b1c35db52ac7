"""Assemble a decoder-only language model from a :class:`~zoo.core.spec.ModelSpec`.

Every part is looked up in the registry by the name the spec gives; this module knows no
specific norm, attention or family. Data flows: ids -> embeddings (+ absolute positions)
-> blocks -> final norm -> head (+ soft-cap) -> logits.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Mapping, Optional

import torch
import torch.nn.functional as F
from torch import nn

from zoo.core import deprecations as _deprecations
from zoo.core import kinds as _kinds
from zoo.core import kernels as _kernels
from zoo.core import precision as _precision
from zoo.core import registry as _registry
from zoo.core.context import ForwardContext, document_positions
from zoo.core.kinds import PositionEncoding, PositionState, rotary_dim_of
from zoo.model.loss import LossOutput, lm_loss, vocab_parallel_lm_loss
from zoo.model.mtp import MTP
from zoo.core.spec import ModelSpec
from zoo.core.state import DecodeState, step_layout


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

    # -- initialisation --------------------------------------------------------------------------
    @torch.no_grad()
    def init_weights(self, generator: Optional[torch.Generator] = None, *, seed: Optional[int] = None) -> None:
        """Normal(0, init_std) for matrices and embeddings, zeros for biases; parts with their own
        rule (norms, learned scales, experts) implement ``reset_parameters``. Matrices, embeddings and
        the torch modules inside parts (a ``Conv1d``, with its own ``reset_parameters``) come first;
        then each part's ``reset_parameters``, inner parts before the parts holding them, so that a
        part's own initialisation is final.

        Every module draws from its own generator, seeded from ``seed`` and the module's name
        (:func:`init_seed`), on the whole of each parameter: a model sharded by FSDP2 (DTensor
        parameters) gets each whole parameter of one module at a time, initialised as one process
        initialises it, and keeps its shard. So the weights are the same whatever the layout.
        ``reset_parameters`` is called with ``generator=`` and ``std=`` when it takes them; one that
        does not (a plugin's) runs with the global RNG seeded the same way. Without ``seed``, it
        is drawn from ``generator`` (or the global RNG)."""
        if seed is None:
            device = generator.device if generator is not None else "cpu"
            seed = int(torch.randint(0, 2**62, (), generator=generator, device=device))
        std = self.spec.init_std
        plain, parts = [], []
        for name, module in self.named_modules():
            (parts if module is not self and _kinds.is_part(module) else plain).append((name, module))
        for name, module in plain + parts[::-1]:
            takes = _init_keywords(module)
            if not isinstance(module, (nn.Linear, nn.Embedding)) and takes is None and module is not self:
                continue
            tensors = [t for t in (*module.parameters(recurse=False), *module.buffers(recurse=False))]
            device = tensors[0].device if tensors else torch.device("cpu")
            seeded = init_seed(seed, _module_name(name))
            gen = torch.Generator(device=device).manual_seed(seeded)
            with _whole_parameters(module):
                if module is self:
                    if self.head_bias is not None:
                        self.head_bias.zero_()
                elif isinstance(module, (nn.Linear, nn.Embedding)):
                    module.weight.normal_(0.0, std, generator=gen)
                    if getattr(module, "bias", None) is not None:
                        module.bias.zero_()
                elif "generator" in takes:
                    module.reset_parameters(generator=gen, **({"std": std} if "std" in takes else {}))
                else:  # a part that draws from the global RNG, if at all: seed it the same way
                    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
                        torch.manual_seed(seeded)
                        module.reset_parameters()

    # -- tensor parallelism ------------------------------------------------------------------------
    def parallelize(self, tp_mesh) -> None:
        """Tensor and sequence parallelism over ``tp_mesh`` (torch.distributed.tensor.parallel), asked of
        each part (:func:`zoo.core.kinds.parallelize`): call it on the meta device, before activation
        checkpointing and FSDP2, then materialise and :meth:`init_weights`. The embedding is sharded by
        vocabulary rows and hands the blocks this process's slice of the sequence; that slice is the
        residual stream all through; the head (the embedding's rows when tied) computes this process's
        vocabulary columns from the whole sequence; the loss keeps them sharded (vocabulary-parallel),
        and a forward without labels gathers the logits whole. A part without a plan is an error naming it."""
        from torch.distributed.tensor import Replicate, Shard, distribute_tensor
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

        from zoo.core.kinds import parallelize

        self._tp = tp_mesh.size()
        parallelize_module(self.embed, tp_mesh, RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)))
        for key, module in self.positions.items():
            parallelize(module, tp_mesh, f"positions.{key} ({type(module).__name__})")
        for i, layer in enumerate(self.layers):
            parallelize(layer, tp_mesh, f"layers.{i}", prefix=f"layers.{i}")
        if self.final_norm is not None:
            parallelize(self.final_norm, tp_mesh, "final_norm", shard_dim=1)
        if self.lm_head is not None:
            parallelize_module(self.lm_head, tp_mesh, ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate()))
        elif self.head_bias is not None:  # tied: the embedding's rows are the head's; its bias follows them
            self.head_bias = nn.Parameter(distribute_tensor(self.head_bias, tp_mesh, [Shard(0)]))
        if self.mtp is not None:  # its modules; the embedding and the head are those above
            self.mtp.parallelize(tp_mesh)

    def parallelize_experts(self, ep_mesh) -> list[nn.Module]:
        """Expert parallelism over ``ep_mesh``, asked of each FFN (``parallelize_experts``, the MTP modules'
        included): call it on the meta device after :meth:`parallelize` and before activation checkpointing
        and FSDP2. Returns the modules whose parameters are now sharded by expert. A model with no part
        that shards its experts (no ``moe`` FFN) is an error."""
        sharded: list[nn.Module] = []
        for name, module in self.named_modules():
            if module is self or not (_kinds.is_part(module) and _kinds.implements(module, "parallelize_experts")):
                continue
            try:
                sharded += module.parallelize_experts(ep_mesh)
            except (ValueError, NotImplementedError) as exc:
                raise type(exc)(f"{_module_name(name)}: {exc}") from None
        if not sharded:
            raise ValueError(f"parallel.ep = {ep_mesh.size()}: this model has no routed experts to shard (no FFN "
                             "implements parallelize_experts, as the moe FFN does); set ep = 1")
        return sharded

    # -- decoding ---------------------------------------------------------------------------------
    def _apply(self, fn, recurse=True):
        # .to(dtype), .half(), .bfloat16(): tensors a part declares float32 stay float32 (zoo/core/precision.py)
        return _precision.apply_keeping_fp32(self, super()._apply, fn, recurse)

    def new_state(self, batch: Optional[int], max_len: Optional[int] = None, *, dtype=None, device=None) -> DecodeState:
        """A decode state for ``batch`` rows of up to ``max_len`` tokens (None: unknown): each
        layer's mixer makes its own state. A model with a mixer that cannot decode is refused."""
        p = next(self.parameters())
        dtype, device = dtype or p.dtype, device or p.device
        layers = []
        for i, layer in enumerate(self.layers):
            mixer = layer.mixer
            state = _kinds.adapt_state(mixer.new_state(batch, max_len, dtype=dtype, device=device))
            if state is None:
                raise ValueError(
                    f"layer {i}'s mixer {type(mixer).__name__} ({self.spec.layer(i).mixer.name!r}) keeps no decode state "
                    "(it has no new_state, or it returned None), so this model cannot decode incrementally; "
                    "see docs/plugins.md, 'A mixer with its own state'")
            layers.append(state)
        return DecodeState(layers, batch=batch, max_len=max_len, device=device)

    # -- forward ----------------------------------------------------------------------------------
    def context(self, input_ids: torch.Tensor, attention_mask: Optional[torch.Tensor] = None,
                position_ids: Optional[torch.Tensor] = None, state: Optional[DecodeState] = None,
                document_ids: Optional[torch.Tensor] = None) -> ForwardContext:
        """The forward context of ``input_ids`` (B, T): slots, padding mask and position ids, after
        what ``state`` has seen (and moving ``state`` on). ``document_ids`` (B, T) numbers the packed
        documents of each row (non-decreasing along it): positions restart at each document, and every
        mixer keeps each document to itself (:func:`document_positions`)."""
        B, T = input_ids.shape
        tp = getattr(self, "_tp", 1)
        if T % tp:
            raise ValueError(f"input_ids: {T} tokens do not split over tp = {tp} processes (sequence parallelism "
                             f"gives each an equal slice); use a length divisible by {tp}")
        if state is not None:
            slots, key_mask, positions = state.advance(B, T, input_ids.device, attention_mask)
        else:
            slots, key_mask, positions = step_layout(B, T, input_ids.device, attention_mask)
        if document_ids is not None:
            self._check_documents(document_ids, B, T, state, attention_mask)
            positions = document_positions(document_ids)
        ctx = ForwardContext(position_ids=positions if position_ids is None else position_ids, slots=slots,
                              key_mask=key_mask, state=state)
        ctx.documents = document_ids
        ctx.n_layers = len(self.layers)
        return ctx

    def _check_documents(self, documents: torch.Tensor, B: int, T: int, state, attention_mask) -> None:
        if tuple(documents.shape) != (B, T):
            raise ValueError(f"document_ids has shape {tuple(documents.shape)}; expected (batch, seq) = {(B, T)}")
        if state is not None or attention_mask is not None:
            raise ValueError("document_ids: packed documents are a training forward over whole sequences; pass no "
                             "decode state or attention_mask with them (padding is a document of its own)")
        if self.mtp is not None:
            raise ValueError("document_ids: the multi-token prediction modules do not keep packed documents apart; "
                             "train this model with packing = 'plain'")
        for i in range(len(self.layers)):
            cls = self.spec.layer(i).mixer.cls
            if not getattr(cls, "documents", False):
                raise ValueError(f"document_ids: layer {i}'s mixer {self.spec.layer(i).mixer.name!r} does not keep "
                                 "packed documents apart (it states no documents = True); train it with packing = "
                                 "'plain'")

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
            logits = _tied_logits(x, weight, bias)
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

    def _local_logits(self, x: torch.Tensor) -> tuple[torch.Tensor, int, Any]:
        """Under tensor parallelism: this process's vocabulary columns of the logits of the whole
        sequence (``x`` is the sequence slice; it is gathered, and its gradient is summed and
        scattered back), the first column's index, and the mesh. Padding columns beyond the
        vocabulary are -inf, which the loss ignores as it ignores the columns cut off without TP."""
        from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

        weight, bias = self.head()
        mesh = weight.device_mesh
        x = DTensor.from_local(x, mesh, [Shard(1)], run_check=False).redistribute(mesh, [Replicate()])
        logits = F.linear(x.to_local(grad_placements=[Partial()]), weight.to_local(),
                          None if bias is None else bias.to_local())
        rows = -(-weight.shape[0] // mesh.size())  # DTensor's Shard(0): chunks of ceil(V / tp) rows
        start = mesh.get_local_rank() * rows
        logits = self._head_scaled(logits)
        if start + logits.shape[-1] > self.spec.vocab_size:
            padding = torch.arange(start, start + logits.shape[-1], device=logits.device) >= self.spec.vocab_size
            logits = logits.masked_fill(padding, float("-inf"))
        return logits, start, mesh

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
        the model, not the reverse), so this reaches it with a lazy import."""
        _deprecations.warn("Decoder.generate(...)")
        from zoo.inference.generate import generate

        return generate(self, input_ids, max_new_tokens, **kwargs)


def _tied_logits(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
    """Logits from the embedding matrix. Under tensor parallelism (a DTensor sharded by vocabulary rows)
    ``x`` is this process's slice of the sequence: it is gathered, each process computes its
    vocabulary columns, and the logits are gathered whole."""
    from torch.distributed.tensor import DTensor, Replicate, Shard

    if not isinstance(weight, DTensor):
        return F.linear(x, weight, bias)
    mesh = weight.device_mesh
    x = DTensor.from_local(x, mesh, [Shard(1)], run_check=False).redistribute(mesh, [Replicate()])
    return F.linear(x, weight, bias).full_tensor()


def init_seed(seed: int, name: str) -> int:
    """The seed of the generator that initialises module ``name`` (a dotted name in the model, as
    ``named_modules`` gives it) of a model built with ``seed``."""
    import hashlib

    digest = hashlib.blake2b(f"{seed}:{name}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & (2**63 - 1)


# Names that wrappers (activation checkpointing, torch.compile, FSDP1) insert between a module and its parts.
_WRAPPER_NAMES = ("_checkpoint_wrapped_module", "_orig_mod", "_fsdp_wrapped_module")


def _module_name(name: str) -> str:
    return ".".join(p for p in name.split(".") if p not in _WRAPPER_NAMES)


def _init_keywords(module: nn.Module) -> Optional[frozenset[str]]:
    """The keywords a module's ``reset_parameters`` takes (None: it has none)."""
    import inspect

    fn = getattr(module, "reset_parameters", None)
    if not callable(fn):
        return None
    return frozenset(inspect.signature(fn).parameters)


@contextlib.contextmanager
def _whole_parameters(module: nn.Module):
    """Within the block, the module's own sharded (DTensor) parameters are whole plain tensors;
    after it, each process keeps its shard of what they were set to. Every process computes the
    same whole tensors, so taking the local shard needs no communication. At most one module's
    own parameters are whole at a time."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    sharded = {n: p for n, p in module._parameters.items() if isinstance(p, DTensor)}
    for n, p in sharded.items():
        module._parameters[n] = nn.Parameter(torch.empty(p.shape, dtype=p.dtype, device=p.to_local().device),
                                             requires_grad=p.requires_grad)
    try:
        yield
        for n, p in sharded.items():
            shard = distribute_tensor(module._parameters[n].detach(), p.device_mesh, p.placements, src_data_rank=None)
            p.to_local().copy_(shard.to_local())
    finally:
        for n, p in sharded.items():
            module._parameters[n] = p


@contextlib.contextmanager
def _no_default_init():
    """Skip torch's own initialisation of Linear and Embedding while building on the meta device.

    Those random inits are thrown away (``init_weights`` or a checkpoint fills the weights), and on
    meta tensors they cost over a second the first time in a process (torch imports its Python
    decompositions for them), which would dominate building even the largest preset.
    """
    saved = nn.Linear.reset_parameters, nn.Embedding.reset_parameters
    nn.Linear.reset_parameters = nn.Embedding.reset_parameters = lambda self: None
    try:
        yield
    finally:
        nn.Linear.reset_parameters, nn.Embedding.reset_parameters = saved


def build_model(
    spec: ModelSpec,
    *,
    device: Optional[torch.device | str] = None,
    dtype: Optional[torch.dtype] = None,
    seed: Optional[int] = None,
) -> Decoder:
    """Build on the meta device (no allocation), then materialise on ``device`` and initialise."""
    with torch.device("meta"), _no_default_init():
        model = Decoder(spec)
    if dtype is not None:
        model = model.to(dtype)
    device = torch.device(device) if device is not None else torch.device("cpu")
    if device.type != "meta":
        model = model.to_empty(device=device)
        model.init_weights(seed=seed)
    return model

"""Autoregressive generation with a decode state: prefill the prompt once, then one token at a time.

Greedy by default (``temperature=0``); sampling with temperature, top-k and top-p (nucleus) from a
seeded generator. Batched prompts are left-padded and come with an ``attention_mask``; padding
never becomes a key and position ids skip it, so each row generates what it would alone.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Optional, Union

import torch

from zoo.core.deprecations import warn
from zoo.core.spec import MAX_SIZES
from zoo.core.state import DecodeState
from zoo.inference.compiled import CompiledDecoder
from zoo.inference.speculative import speculative_generate


def _stop_ids(stop: Union[None, int, Iterable[int]]) -> list[int]:
    if stop is None:
        return []
    if isinstance(stop, int):
        return [stop]
    ids = [int(s) for s in stop]
    return ids


def length_limit(spec) -> tuple[int, str]:
    """The longest sequence the model can generate, and what sets it: a position encoding with a
    hard limit (a learned table: max_seq_len), else zoo's bound on any context (RoPE extrapolates)."""
    if spec is not None:
        for i in range(spec.n_layers):
            part = spec.position_for(i)
            hard = part.cls.max_positions(part.config, spec)
            if hard is not None:
                return hard, f"the {part.name} position encoding's limit (max_seq_len)"
    return MAX_SIZES["max_seq_len"], "zoo's limit on a context"


def _check_generate_inputs(model, input_ids: torch.Tensor, max_new_tokens: int, *, attention_mask, stops: list[int],
                           pad_token_id: Optional[int], temperature, top_k, top_p) -> None:
    """Refuse, naming the argument, every input that would fail (or silently misbehave) midway."""
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int):
        raise ValueError(f"max_new_tokens must be an integer, got {max_new_tokens!r}")
    if input_ids.dtype.is_floating_point or input_ids.dtype.is_complex or input_ids.dtype == torch.bool:
        raise ValueError(f"input_ids must hold integer token ids, got dtype {input_ids.dtype}")
    spec = getattr(model, "spec", None)
    vocab = getattr(spec, "vocab_size", None)
    if vocab is not None and input_ids.numel():
        low, high = int(input_ids.min()), int(input_ids.max())
        if low < 0 or high >= vocab:
            bad = low if low < 0 else high
            raise ValueError(f"input_ids holds token id {bad}, outside the model's vocabulary [0, {vocab})")
    bad_stops = [s for s in stops if s < 0 or (vocab is not None and s >= vocab)]
    if bad_stops:
        raise ValueError(f"stop holds token id {bad_stops[0]}, outside the model's vocabulary [0, {vocab})")
    if pad_token_id is not None and pad_token_id < 0:
        raise ValueError(f"pad_token_id must be >= 0, got {pad_token_id}")
    limit, what = length_limit(spec)
    if input_ids.shape[1] + max_new_tokens > limit:
        raise ValueError(
            f"max_new_tokens {max_new_tokens} after a prompt of {input_ids.shape[1]} tokens reaches "
            f"{input_ids.shape[1] + max_new_tokens}, beyond {what} {limit}; generate at most "
            f"{max(0, limit - input_ids.shape[1])} tokens"
        )
    if attention_mask is not None and not bool(((attention_mask == 0) | (attention_mask == 1)).all()):
        raise ValueError("attention_mask must hold only 0 (padding) and 1 (a real token); "
                         f"it holds {sorted(set(attention_mask.unique().tolist()) - {0, 1})[:3]}")
    if temperature is not None and not (isinstance(temperature, (int, float)) and math.isfinite(temperature)
                                        and temperature >= 0):
        raise ValueError(f"temperature must be a finite number >= 0, got {temperature!r}")
    if top_k is not None and (isinstance(top_k, bool) or not isinstance(top_k, int) or top_k <= 0):
        raise ValueError(f"top_k must be a positive integer, got {top_k!r}")
    if top_p is not None and not 0.0 < top_p <= 1.0:
        raise ValueError(f"top_p must be in (0, 1], got {top_p!r}")


def sample_next(
    logits: torch.Tensor,
    *,
    temperature: float = 0.0,
    top_k: Optional[int] = None,
    top_p: Optional[float] = None,
    generator: Optional[torch.Generator] = None,
) -> torch.Tensor:
    """Pick the next token from (B, vocab) logits: argmax when ``temperature`` is 0, otherwise a
    draw from softmax(logits / temperature) restricted to the top-k tokens and to the smallest
    set whose probability reaches top-p."""
    if temperature is None or temperature == 0:
        return logits.argmax(dim=-1)
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    logits = logits.float() / temperature
    if top_k is not None:
        if top_k <= 0:
            raise ValueError(f"top_k must be a positive integer, got {top_k}")
        kth = torch.topk(logits, min(top_k, logits.shape[-1]), dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is not None:
        if not 0.0 < top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {top_p}")
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        probs = sorted_logits.softmax(-1)
        # Drop a token when the tokens before it already reach top_p (the first always stays).
        drop = probs.cumsum(-1) - probs >= top_p
        logits = logits.scatter(-1, order, sorted_logits.masked_fill(drop, float("-inf")))
    probs = logits.softmax(-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


@dataclass(frozen=True)
class Generation:
    """How to continue a prompt, one name per idea.

    ``max_new_tokens``: at most this many new tokens. ``temperature`` 0 decodes greedily; above 0 it
    samples from softmax(logits / temperature), within the ``top_k`` tokens and the smallest set
    whose probability reaches ``top_p``, from a generator seeded with ``seed``. ``stop``: the token
    ids that end a sequence; a row that produced one is filled with ``pad_token_id`` (default: the
    first stop id) until every row is, then generation ends. ``callback`` receives each new (B,)
    column of tokens as it is produced. ``compile=True``: prefill eagerly, then decode with one
    ``torch.compile``d step over a static decode state (zoo.inference.compiled).
    ``speculative="mtp"``: greedy self-speculative decoding, the model's multi-token prediction module
    drafting and the main model verifying (one sequence at a time; the same tokens as plain greedy).

    transformers' spellings (``do_sample``, ``eos_token_id``, ``streamer``) are read at the edges,
    by :meth:`from_transformers`."""

    max_new_tokens: int = 32
    temperature: float = 0.0
    top_k: Optional[int] = None
    top_p: Optional[float] = None
    seed: Optional[int] = None
    stop: tuple[int, ...] = ()
    pad_token_id: Optional[int] = None
    callback: Optional[Callable[[torch.Tensor], None]] = None
    compile: bool = False
    speculative: Optional[str] = None

    def __post_init__(self):
        object.__setattr__(self, "stop", tuple(_stop_ids(self.stop)))

    @classmethod
    def from_transformers(cls, *, do_sample: Optional[bool] = None, eos_token_id: Union[None, int, Iterable[int]] = None,
                          streamer: Any = None, **settings: Any) -> "Generation":
        """The settings transformers' ``generate`` keywords ask for: ``do_sample=False`` decodes
        greedily whatever ``temperature`` says, ``do_sample=True`` samples at ``temperature`` or, when
        that is 0, at transformers' default of 1.0; ``eos_token_id`` (an id or ids) adds to ``stop``; a
        ``streamer`` (``put`` each column, ``end``; its ``end`` is the caller's to call) is the
        ``callback``. The other keywords are :class:`Generation`'s own."""
        if do_sample is not None and not isinstance(do_sample, bool):
            raise ValueError(f"do_sample must be True or False, got {do_sample!r}")
        if do_sample is False:
            settings["temperature"] = 0.0
        elif do_sample and not settings.get("temperature"):
            settings["temperature"] = 1.0
        if eos_token_id is not None:
            settings["stop"] = list(dict.fromkeys(_stop_ids(settings.get("stop")) + _stop_ids(eos_token_id)))
        if streamer is not None:
            settings["callback"] = streamer.put
        return cls(**settings)


#: generate's keywords that are transformers' spellings of a Generation setting, read at the edges
_TRANSFORMERS = {"do_sample": "generate(do_sample=)", "eos_token_id": "generate(eos_token_id=)",
                 "streamer": "generate(streamer=)"}


@torch.no_grad()
def generate(
    model,
    input_ids: torch.Tensor,
    max_new_tokens: Optional[int] = None,
    settings: Optional[Generation] = None,
    *,
    attention_mask: Optional[torch.Tensor] = None,
    state: Optional[DecodeState] = None,
    stats=None,
    cache: Optional[DecodeState] = None,
    **keywords: Any,
) -> torch.Tensor:
    """Continue ``input_ids`` (B, T) as ``settings`` (a :class:`Generation`) say; returns (B, T + n)
    token ids. ``max_new_tokens`` and keywords named as :class:`Generation`'s fields
    (``temperature=``, ``stop=``, ...) set those fields (over ``settings``).

    ``attention_mask`` (B, T): 1 for real tokens, 0 for left padding. ``state`` continues a decode
    state the caller keeps. ``stats`` (a :class:`zoo.inference.speculative.SpeculationStats`)
    receives the drafts made and accepted by ``speculative="mtp"``. transformers' spellings
    (``do_sample``, ``eos_token_id``, ``streamer``) and ``cache`` (``state``'s old name) still work and
    warn: read them with :meth:`Generation.from_transformers` where they come in.
    """
    unknown = sorted(set(keywords) - set(_FIELDS) - set(_TRANSFORMERS))
    if unknown:
        raise TypeError(f"generate() got an unexpected keyword argument {unknown[0]!r}; its settings are "
                        f"{', '.join(_FIELDS)} (zoo.inference.generate.Generation)")
    streamer = keywords.get("streamer")
    for name in _TRANSFORMERS:
        if name in keywords:
            warn(_TRANSFORMERS[name])
    fields = {name: getattr(settings or _DEFAULT, name) for name in _FIELDS}
    if max_new_tokens is not None:
        fields["max_new_tokens"] = max_new_tokens
    fields.update(keywords)
    settings = Generation.from_transformers(**fields)
    if cache is not None:
        warn("the cache= keyword")
    state = state if state is not None else cache
    out = _generate(model, input_ids, settings, attention_mask=attention_mask, state=state, stats=stats)
    if streamer is not None and hasattr(streamer, "end"):
        streamer.end()
    return out


_FIELDS = tuple(f.name for f in dataclasses.fields(Generation))
_DEFAULT = Generation()


def _generate(model, input_ids: torch.Tensor, settings: Generation, *, attention_mask, state, stats) -> torch.Tensor:
    max_new_tokens, temperature, top_k, top_p = (settings.max_new_tokens, settings.temperature, settings.top_k,
                                                 settings.top_p)
    pad_token_id, callback, compile, speculative = (settings.pad_token_id, settings.callback, settings.compile,
                                                    settings.speculative)
    if input_ids.dim() == 1:
        input_ids = input_ids.unsqueeze(0)
    if input_ids.dim() != 2 or input_ids.shape[1] == 0:
        raise ValueError(f"input_ids must be a non-empty (batch, seq) tensor of token ids, got shape {tuple(input_ids.shape)}")
    if max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
    if attention_mask is not None and attention_mask.shape != input_ids.shape:
        raise ValueError(f"attention_mask has shape {tuple(attention_mask.shape)}; it must match input_ids {tuple(input_ids.shape)}")
    stops = list(settings.stop)
    _check_generate_inputs(model, input_ids, max_new_tokens, attention_mask=attention_mask, stops=stops,
                           pad_token_id=pad_token_id, temperature=temperature, top_k=top_k, top_p=top_p)
    if attention_mask is not None and not bool(attention_mask[:, -1].all()):
        raise ValueError("attention_mask: batched prompts must be left-padded (the last column must be all ones)")
    if speculative is not None:
        if speculative != "mtp":
            raise ValueError(f"speculative must be None or 'mtp', got {speculative!r}")
        if temperature or compile or state is not None:
            raise ValueError("speculative='mtp' decodes greedily with its own decode state: "
                             "pass temperature=0, compile=False and no state")
        return speculative_generate(model, input_ids, max_new_tokens, attention_mask=attention_mask, stops=stops,
                                    stats=stats, emit=callback)
    pad = pad_token_id if pad_token_id is not None else (stops[0] if stops else 0)
    device = input_ids.device
    gen = None
    if settings.seed is not None:
        gen = torch.Generator(device=device).manual_seed(settings.seed)
    if compile:
        if state is not None:
            raise ValueError("state: compile=True decodes with its own static state; pass state=None")
        step = CompiledDecoder(model, input_ids.shape[1], max_new_tokens)
    else:
        if state is None:
            state = model.new_state(input_ids.shape[0], input_ids.shape[1] + max_new_tokens)

        def step(ids, mask):
            return model.logits_from_hidden(model.hidden_states(ids, attention_mask=mask, state=state)[:, -1])
    emit = callback
    B = input_ids.shape[0]
    out = [input_ids]
    done = torch.zeros(B, dtype=torch.bool, device=device)
    stop_t = torch.tensor(stops, device=device) if stops else None
    step_ids, mask = input_ids, attention_mask
    for _ in range(max_new_tokens):
        logits = step(step_ids, mask)
        nxt = sample_next(logits, temperature=temperature, top_k=top_k, top_p=top_p, generator=gen)
        nxt = torch.where(done, torch.full_like(nxt, pad), nxt)
        out.append(nxt[:, None])
        if emit is not None:
            emit(nxt)
        if stop_t is not None:
            done = done | torch.isin(nxt, stop_t)
            if bool(done.all()):
                break
        step_ids, mask = nxt[:, None], None
    return torch.cat(out, dim=1)

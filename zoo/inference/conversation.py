"""Chat: a conversation rendered with the tokenizer's chat template, answered by :func:`zoo.generate`.

    >>> messages = [{"role": "user", "content": "What is the capital of France?"}]
    >>> reply = zoo.chat(model, messages, tokenizer)          # greedy, stops at the end of the turn
    >>> messages += [{"role": "assistant", "content": reply}, {"role": "user", "content": "And of Italy?"}]

The template is the Jinja template the checkpoint ships (``tokenizer_config.json``'s
``chat_template``, ``chat_template.jinja`` or a GGUF file's ``tokenizer.chat_template``), rendered
as transformers renders it: a sandboxed environment with ``trim_blocks`` and ``lstrip_blocks``,
``raise_exception`` and ``tojson``.
"""

from __future__ import annotations

import json
from typing import Callable, Optional

import torch


def render(template: str, messages: list[dict], *, add_generation_prompt: bool = True, **variables) -> str:
    """``template`` applied to ``messages`` (each ``{"role": ..., "content": ...}``)."""
    try:
        from jinja2.exceptions import TemplateError
        from jinja2.sandbox import ImmutableSandboxedEnvironment
    except ImportError:
        raise RuntimeError("chat templates need jinja2: pip install jinja2") from None

    def raise_exception(message):
        raise TemplateError(message)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = lambda x, indent=None, ensure_ascii=False: json.dumps(x, indent=indent, ensure_ascii=ensure_ascii)
    env.globals["raise_exception"] = raise_exception
    try:
        return env.from_string(template).render(messages=messages, add_generation_prompt=add_generation_prompt,
                                                **variables)
    except TemplateError as exc:
        raise ValueError(f"the chat template refused the conversation: {exc}") from None


def _check(messages) -> None:
    if not isinstance(messages, list) or not messages:
        raise ValueError("messages must be a non-empty list of {'role': ..., 'content': ...} dicts")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise ValueError(f"messages[{i}] must be a dict with a string 'role' and a string 'content', got {m!r}")


def chat(model, messages: list[dict], tokenizer, *, max_new_tokens: int = 256, on_text: Optional[Callable[[str], None]] = None,
         **generate_kw) -> str:
    """The model's reply to ``messages`` (the text of the assistant's next turn).

    The conversation is rendered with ``tokenizer.chat_template`` and continued by
    :func:`zoo.generate` (greedy unless ``temperature`` > 0; ``top_k``, ``top_p`` and ``seed`` as
    there), stopping at the tokenizer's end-of-turn / end-of-sequence ids. ``on_text`` receives the
    reply's text as it is produced, in pieces safe to print.
    """
    from zoo.inference.generate import generate
    from zoo.inference.tokenizer import TextStream

    _check(messages)
    template = getattr(tokenizer, "chat_template", None)
    if not template:
        raise ValueError(f"the tokenizer ({getattr(tokenizer, 'path', tokenizer)}) has no chat template; "
                         "use zoo generate with a plain prompt instead")
    text = render(template, messages, bos_token=tokenizer.bos_token or "")
    # The template writes the special tokens (BOS included) itself.
    ids = torch.tensor([tokenizer.encode(text, add_special_tokens=False)])
    stream, reply = TextStream(tokenizer), []
    stop = set(tokenizer.eos_token_ids)

    def show(column):
        token = int(column[0])
        if token in stop:
            return
        reply.append(token)
        piece = stream.push(token)
        if piece and on_text is not None:
            on_text(piece)

    generate(model, ids, max_new_tokens, stop=sorted(stop) or None, callback=show, **generate_kw)
    return tokenizer.decode(reply)

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


# The work a template from a file may do (transformers bounds none of it): loop iterations and calls,
# the size of any value it makes (a string, a list, a number's bits) and of the text it renders.
MAX_STEPS = 1_000_000
MAX_TEXT = 1 << 22  # characters (or list items) in one value and in the rendered text
MAX_INT_BITS = 1 << 16
MAX_ARGUMENT = 1 << 16  # an integer passed to a filter or call (an indent, a width, a range)


class TemplateLimit(ValueError):
    """A chat template that would do more work than any conversation needs."""


def _size(value, seen=None) -> int:
    """About how many characters ``value`` prints as (a number's digits, a list's items' sizes)."""
    if isinstance(value, str):
        return len(value)
    if isinstance(value, bool) or value is None:
        return 5
    if isinstance(value, int):
        return value.bit_length() // 3 + 1
    if isinstance(value, (list, tuple, dict)):
        seen = {} if seen is None else seen
        if id(value) not in seen:
            seen[id(value)] = 2 + len(value)  # a list that holds itself counts once
            items = value.items() if isinstance(value, dict) else ((v, "") for v in value)
            total = 2 + len(value)
            for k, v in items:
                total += _size(k, seen) + _size(v, seen)
                if total > MAX_TEXT:
                    break
            seen[id(value)] = total
        return seen[id(value)]
    return 16


def _sandbox():
    """transformers' chat-template environment (sandboxed, ``trim_blocks``, ``lstrip_blocks``, loop
    controls, ``raise_exception``, ``tojson``) with every amount of work bounded: each ``for`` loop's
    items and each call count against :data:`MAX_STEPS`; ``*``, ``**``, ``+``, ``%`` and ``~`` are
    refused before they would make a value past :data:`MAX_TEXT` (or a number past
    :data:`MAX_INT_BITS`); an integer argument to a filter, test or call (``indent=3000000000``,
    ``lipsum(n=10**7)``) is at most :data:`MAX_ARGUMENT`; ``{% include %}`` and ``{% import %}``
    find no template."""
    from jinja2 import BaseLoader, nodes
    from jinja2.exceptions import TemplateError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Sandbox(ImmutableSandboxedEnvironment):
        intercepted_binops = frozenset(("*", "**", "+", "%"))
        steps = 0

        def step(self, n: int = 1) -> None:
            self.steps += n
            if self.steps > MAX_STEPS:
                raise TemplateLimit(f"the chat template does more than {MAX_STEPS:,} loop iterations and calls; "
                                    "no conversation needs that much (a hostile or broken template)")

        def _parse(self, source, name, filename):
            tree = super()._parse(source, name, filename)
            for loop in tree.find_all(nodes.For):  # each loop's items are counted as they are taken
                loop.iter = nodes.Filter(loop.iter, "_zoo_counted", [], [], None, None, lineno=loop.lineno)
            for concat in tree.find_all(nodes.Concat):  # a ~ b ~ c: the sizes are checked before joining
                concat.nodes = [nodes.Filter(nodes.List(concat.nodes), "_zoo_joined", [], [], None, None,
                                             lineno=concat.lineno)]
            return tree

        def call_binop(self, context, operator, left, right):
            if operator == "**" and isinstance(left, int) and isinstance(right, int) and right > 0 and \
                    abs(left) > 1 and abs(left).bit_length() * right > MAX_INT_BITS:
                raise TemplateLimit(f"{left} ** {right} in the chat template is a number beyond {MAX_INT_BITS:,} bits")
            if operator == "*":
                for seq, n in ((left, right), (right, left)):
                    if isinstance(n, int) and not isinstance(n, bool) and isinstance(seq, (str, list, tuple)) \
                            and n * _size(seq) > MAX_TEXT:
                        raise TemplateLimit(f"a value of size {_size(seq):,} times {n:,} in the chat template is "
                                            f"beyond {MAX_TEXT:,} characters")
                if isinstance(left, int) and isinstance(right, int) and \
                        left.bit_length() + right.bit_length() > MAX_INT_BITS:
                    raise TemplateLimit(f"a product in the chat template is a number beyond {MAX_INT_BITS:,} bits")
            if operator in ("+", "%") and _size(left) + _size(right) > MAX_TEXT:
                raise TemplateLimit(f"a value in the chat template would be beyond {MAX_TEXT:,} characters")
            if operator == "%" and isinstance(left, str):
                import re

                if any(int(w) > MAX_ARGUMENT for w in re.findall(r"%[-+ #0]*(\d+)", left) + re.findall(r"\.(\d+)", left)):
                    raise TemplateLimit(f"a %-format width in the chat template is beyond {MAX_ARGUMENT:,}")
            return super().call_binop(context, operator, left, right)

        def call(__self, __context, __obj, *args, **kwargs):
            __self.step()
            _arguments(args, kwargs, getattr(__obj, "__name__", "a call"))
            return super().call(__context, __obj, *args, **kwargs)

    def _arguments(args, kwargs, what):
        for a in (*args, *kwargs.values()):
            if isinstance(a, int) and not isinstance(a, bool) and abs(a) > MAX_ARGUMENT:
                raise TemplateLimit(f"the chat template passes {a:,} to {what}, beyond zoo's limit of {MAX_ARGUMENT:,}")

    def bounded(name, f):
        def checked(*args, **kwargs):
            _arguments(args[1:] if name in PASS_ENV else args, kwargs, f"the {name} filter")
            return f(*args, **kwargs)
        for attr in ("jinja_pass_arg",):  # keep pass_context / pass_environment / pass_eval_context
            if hasattr(f, attr):
                setattr(checked, attr, getattr(f, attr))
        return checked

    def raise_exception(message):
        raise TemplateError(message)

    class NoTemplates(BaseLoader):
        def get_source(self, environment, template):
            raise TemplateError(f"a chat template cannot include or import other templates ({template!r})")

    env = Sandbox(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"], loader=NoTemplates())

    def counted(items):
        for item in items:
            env.step()
            yield item

    def joined(parts):
        if sum(_size(p) for p in parts) > MAX_TEXT:
            raise TemplateLimit(f"a value in the chat template would be beyond {MAX_TEXT:,} characters")
        return "".join(str(p) for p in parts)

    env.filters["tojson"] = lambda x, indent=None, ensure_ascii=False: json.dumps(x, indent=indent, ensure_ascii=ensure_ascii)
    PASS_ENV = {n for n, f in env.filters.items() if hasattr(f, "jinja_pass_arg")}
    env.filters = {n: bounded(n, f) for n, f in env.filters.items()}
    env.tests = {n: bounded(n, f) for n, f in env.tests.items()}
    env.filters["_zoo_counted"], env.filters["_zoo_joined"] = counted, joined
    env.globals["raise_exception"] = raise_exception
    return env


def render(template: str, messages: list[dict], *, add_generation_prompt: bool = True, **variables) -> str:
    """``template`` applied to ``messages`` (each ``{"role": ..., "content": ...}``), in bounded time and
    memory (see :func:`_sandbox`); a template that does too much or refuses is a ValueError."""
    try:
        from jinja2.exceptions import TemplateError
    except ImportError:
        raise RuntimeError("chat templates need jinja2: pip install jinja2") from None

    env = _sandbox()
    try:
        pieces, total = [], 0
        for piece in env.from_string(template).generate(messages=messages, add_generation_prompt=add_generation_prompt,
                                                        **variables):
            total += len(piece)
            if total > MAX_TEXT:
                raise TemplateLimit(f"the chat template renders more than {MAX_TEXT:,} characters")
            pieces.append(piece)
        return "".join(pieces)
    except TemplateLimit as exc:
        raise ValueError(f"the chat template was stopped: {exc}") from None
    except (TemplateError, RecursionError, OverflowError) as exc:
        raise ValueError(f"the chat template refused the conversation: {type(exc).__name__}: {exc}") from None


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
    ids = torch.tensor([tokenizer.encode(text, add_special_tokens=False)], device=next(model.parameters()).device)
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

"""Chat templates from a file are anyone's code: they render in a sandbox (no attribute escapes) and in
bounded time and memory. Each template here once hung or allocated gigabytes; now each is a ValueError
at once, and a transformers-style list of named templates or a template of the wrong type is read or
refused by name."""

import json

import pytest
from test_hostile_inputs import finishes_within  # the shared guard against a render that hangs

pytest.importorskip("jinja2")

from zoo.inference.conversation import render  # noqa: E402

MESSAGES = [{"role": "user", "content": "Hi"}]


@pytest.mark.parametrize("template, match", [
    ("{% for a in range(60000) %}{% for b in range(60000) %}{% endfor %}{% endfor %}", "loop iterations and calls"),
    ("{% for a in range(100000) %}{% for b in range(100000) %}{% endfor %}{% endfor %}", "beyond zoo's limit"),
    ("{{ lipsum(n=10**7) }}", "passes 10,000,000 to"),
    ("{{ 'x' * 100000 * 100000 }}", "times 100,000 in the chat template"),
    ("{{ [0] * 100000 * 100000 }}", "times 100,000"),
    ("{{ [messages] * 3000000 }}", "times 3,000,000"),
    ("{{ messages|tojson(indent=3000000000) }}", "passes 3,000,000,000 to the tojson filter"),
    ("{{ 'x'|indent(3000000000) }}", "to the indent filter"),
    ("{{ 'x'|center(3000000000) }}", "to the center filter"),
    ("{{ 'x'.center(3000000000) }}", "passes 3,000,000,000"),
    ("{{ '%999999999d' % 1 }}", "%-format width"),
    ("{{ 10 ** 100000000 }}", "bits"), ("{{ (10 ** 60000) * (10 ** 60000) }}", "bits"),
    ("{% set ns = namespace(s='xxxxxxxx') %}{% for i in range(40) %}{% set ns.s = ns.s + ns.s %}{% endfor %}",
     "beyond 4,194,304 characters"),
    ("{% set ns = namespace(s='xxxxxxxx') %}{% for i in range(40) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}",
     "beyond 4,194,304 characters"),
    ("{% for i in range(60000) %}{{ 'y' * 1000 }}{% endfor %}", "renders more than 4,194,304 characters"),
    ("{% macro f() %}{{ f() }}{{ f() }}{% endmacro %}{{ f() }}", "(RecursionError|loop iterations and calls)"),
    ("{% include 'other.jinja' %}", "cannot include or import"),
    ("{% import 'other.jinja' as o %}", "cannot include or import"),
    ("{{ range(10**6) }}", "beyond zoo's limit"),
])
def test_a_template_that_would_hang_or_allocate_is_stopped(template, match):
    with finishes_within(30), pytest.raises(ValueError, match=match):
        render(template, MESSAGES)


def test_the_bounds_leave_ordinary_templates_alone():
    template = ("{% for m in messages %}<|{{ m.role }}|>{{ m.content | trim }}{{ '\\n' * 2 }}{% endfor %}"
                "{{ messages | tojson(indent=2) }}{% if add_generation_prompt %}<|assistant|>{% endif %}"
                "{{ ('%5d' % 7) ~ '-' ~ 2 ** 10 }}{{ ' '.join(['a', 'b']) }}{% for i in range(3) %}{{ loop.index }}"
                "{% endfor %}")
    out = render(template, MESSAGES * 3)
    assert out.startswith("<|user|>Hi\n\n<|user|>Hi") and '"role": "user"' in out and out.endswith("    7-1024a b123")


def test_a_list_of_named_templates_uses_default_as_transformers_does(tmp_path):
    from zoo.inference.tokenizer import chat_template

    named = [{"name": "tool_use", "template": "T"}, {"name": "default", "template": "D"}]
    assert chat_template(named, "x") == "D"
    with pytest.raises(ValueError, match=r"cfg\.json: chat_template names templates \['tool_use'\] but none 'default'"):
        chat_template(named[:1], "cfg.json: chat_template")
    for bad in (7, {"a": 1}, [1, 2]):
        with pytest.raises(ValueError, match=r"cfg\.json: chat_template must be a string or a list"):
            chat_template(bad, "cfg.json: chat_template")


def test_a_tokenizer_config_with_named_templates_loads(tmp_path):
    from tokenizers import Tokenizer as HFTokenizer, models

    from zoo.inference.tokenizer import Tokenizer

    HFTokenizer(models.BPE(vocab={"a": 0, "b": 1}, merges=[])).save(str(tmp_path / "tokenizer.json"))
    config = {"chat_template": [{"name": "default", "template": "{{ messages[0].content }}"}]}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    assert Tokenizer(tmp_path).chat_template == "{{ messages[0].content }}"
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": 42}))
    with pytest.raises(ValueError, match=r"tokenizer_config\.json: chat_template must be a string"):
        Tokenizer(tmp_path)

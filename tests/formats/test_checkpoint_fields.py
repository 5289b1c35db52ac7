"""Field tables (zoo.checkpoints.hf.fields): one declaration read one way and written the other, a
format's difference from its parent, and what a format does not store."""

import pytest
import torch

import zoo
from zoo.checkpoints import CheckpointError, ConfigError
from zoo.checkpoints.hf.fields import Field, FieldTable, read_fields, write_fields
from zoo.checkpoints.hf.format import Fields, get_format
from zoo.checkpoints.hf.formats.llama import LLAMA_FIELDS, TINY, LlamaStyle
from zoo.core import registry as _registry

SMALL = {"n_layers": 2, "d_model": 64, "vocab_size": 128, "layers.*.mixer.n_heads": 4,
         "layers.*.mixer.n_kv_heads": 2, "layers.*.ffn.d_ff": 96}


def test_a_table_reads_into_spec_paths_and_writes_the_same_keys_back():
    spec = get_format("llama").config_to_spec({**TINY, "rms_norm_eps": 1e-5, "mlp_bias": True})
    cfg = write_fields(spec, LLAMA_FIELDS)
    assert {f.hf for f in LLAMA_FIELDS} == set(cfg)
    assert cfg["rms_norm_eps"] == 1e-5 and cfg["mlp_bias"] is True and cfg["hidden_act"] == "silu"
    assert {k: cfg[k] for k in TINY} == TINY
    # and read again: the same spec data for every field of the table
    again = read_fields(Fields(cfg, "llama"), LLAMA_FIELDS)
    assert again["layer"]["norm"]["eps"] == again["final_norm"]["eps"] == 1e-5
    assert again["layer"]["ffn"]["activation"] == {"name": "silu"} and again["head"]["tied"] is False


def test_a_default_may_depend_on_fields_read_before():
    data = read_fields(Fields({"hidden_size": 64, "num_attention_heads": 4}, "t"),
                       [Field("hidden_size", "d_model"), Field("num_attention_heads", "n_heads"),
                        Field("head_dim", "head_dim", lambda v: v["hidden_size"] // v["num_attention_heads"])])
    assert data == {"d_model": 64, "n_heads": 4, "head_dim": 16}


def test_errors_name_the_field():
    with pytest.raises(ConfigError, match="'hidden_size'.*required and missing"):
        read_fields(Fields({}, "t"), [Field("hidden_size", "d_model")])
    with pytest.raises(ConfigError, match="'tie_word_embeddings'.*must be a boolean"):
        read_fields(Fields({"tie_word_embeddings": "no"}, "t"), [Field("tie_word_embeddings", "head.tied", False)])
    with pytest.raises(ConfigError, match="'hidden_act'.*activation 'swoosh' is not supported"):
        get_format("llama").config_to_spec({**TINY, "hidden_act": "swoosh"})


def test_tables_add_replace_and_drop_by_hf_key():
    table = FieldTable([Field("a", "x"), Field("b", "y")])
    grown = table + [Field("b", "z"), Field("c", "w")]
    assert [(f.hf, f.spec) for f in grown] == [("a", "x"), ("b", "z"), ("c", "w")]
    assert [f.hf for f in grown - ("a", "c")] == ["b"]
    with pytest.raises(KeyError, match="'nope'"):
        table - "nope"


def test_a_format_states_only_its_difference_from_its_parent():
    from zoo.checkpoints.hf.formats.llama import Mistral, Qwen2, Qwen3

    assert {f.hf for f in LlamaStyle.fields} - {f.hf for f in Mistral.fields} == {"mlp_bias"}
    assert {f.hf for f in Qwen3.fields} - {f.hf for f in Qwen2.fields} == {"attention_bias"}
    assert Qwen3.template["layer"]["mixer"]["qk_norm"] == "head"
    assert LlamaStyle.template["layer"]["mixer"]["qk_norm"] == "none"  # the parent's template is untouched


# -- what a format does not store ---------------------------------------------------------------

class NoContext(LlamaStyle):
    """A Llama layout whose config has no max_position_embeddings."""

    model_type, architecture = "no_context", "NoContextForCausalLM"
    fields = LlamaStyle.fields - "max_position_embeddings"


class NoContextUndeclared(NoContext):
    model_type = "no_context_undeclared"
    not_stored = ()


@pytest.fixture
def no_context():
    reg = _registry.registry("checkpoint_format")
    for fmt in (NoContext(), NoContextUndeclared()):
        reg.add(fmt.model_type, fmt, provider="tests")
    yield
    for name in ("no_context", "no_context_undeclared"):
        reg.remove(name, "tests")


def test_a_format_without_a_context_field_saves_a_model_of_any_context(no_context, tmp_path):
    assert NoContext().not_stored == ("max_seq_len",)
    assert LlamaStyle().not_stored == ()
    model = zoo.build("llama3-8b", overrides={**SMALL, "max_seq_len": 4096}, seed=0)
    zoo.save_pretrained(model, tmp_path / "out", model_type="no_context")
    loaded = zoo.from_pretrained(tmp_path / "out")
    assert "max_position_embeddings" not in zoo.checkpoints.read_config(tmp_path / "out")
    assert loaded.spec.max_seq_len == 2048  # the format's reading of a config without it
    ids = torch.randint(0, 128, (1, 12))
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids), model(ids), rtol=0, atol=0)


def test_without_declaring_it_the_save_check_names_the_field(no_context, tmp_path):
    model = zoo.build("llama3-8b", device="meta", overrides={**SMALL, "max_seq_len": 4096})
    with pytest.raises(CheckpointError, match="max_seq_len: 4096 in the model, 2048 as the config reads back"):
        zoo.save_pretrained(model, tmp_path / "out", model_type="no_context_undeclared")


def test_not_stored_covers_only_what_it_names(no_context, tmp_path):
    model = zoo.build("llama3-8b", device="meta", overrides={**SMALL, "max_seq_len": 4096, "head.softcap": 30.0})
    with pytest.raises(CheckpointError) as err:
        zoo.save_pretrained(model, tmp_path / "out", model_type="no_context")
    assert "head.softcap" in str(err.value) and "max_seq_len" not in str(err.value)


def test_the_field_table_example_of_docs_checkpoints_runs(tmp_path, monkeypatch):
    import re
    from pathlib import Path

    text = (Path(__file__).resolve().parents[2] / "docs" / "reference" / "checkpoints.md").read_text()
    section = text[text.index("### A format as a field table"):]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    monkeypatch.chdir(tmp_path)
    namespace: dict = {}
    try:
        exec(compile(code, "docs/reference/checkpoints.md (A format as a field table)", "exec"), namespace)
    finally:
        if "nocontext_llama" in _registry.registry("checkpoint_format").names():
            _registry.registry("checkpoint_format").remove("nocontext_llama", "docs")
    assert (tmp_path / "out" / "nocontext" / "config.json").exists()
    assert namespace["fmt"].not_stored == ("max_seq_len",)

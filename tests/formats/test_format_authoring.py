"""What a plugin author relies on: the dropout-field rule, the HF activation names (relu2 built in,
extensible by parts and formats), a save mismatch that names the fields, `zoo list KIND NAME`
showing a part's settings, and zoo.testing's documented examples."""

import json
import re
from dataclasses import dataclass

import pytest
import torch
from torch import nn

import zoo
import zoo.testing as zt
from zoo.checkpoints import CheckpointError, config_to_spec
from zoo.checkpoints.hf.common import activation, activation_name
from zoo.checkpoints.hf.format import ConfigError, Fields
from zoo.cli import main

LLAMA = {"model_type": "llama", "vocab_size": 64, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 64}
SMALL = {"n_layers": 2, "d_model": 32, "vocab_size": 64, "layers.*.mixer.n_heads": 4,
         "layers.*.mixer.n_kv_heads": 2, "layers.*.ffn.d_ff": 64}


def test_every_dropout_field_is_accepted_whatever_its_value():
    spec = config_to_spec({**LLAMA, "embedding_dropout": 0.1, "residual_dropout": 0.2, "attention_dropout": 0.1,
                           "mlp_dropout": 0.3, "resid_pdrop": 0.1})
    assert spec == config_to_spec(LLAMA)
    with pytest.raises(ConfigError, match="'embedding_scale'"):  # not a dropout: refused when strict
        config_to_spec({**LLAMA, "embedding_scale": 2.0}, strict=True)
    assert "embedding_scale" in zoo.checkpoints.ignored_fields({**LLAMA, "embedding_scale": 2.0})
    assert "mlp_dropout" not in zoo.checkpoints.ignored_fields({**LLAMA, "mlp_dropout": 0.3})


def test_relu2_is_an_hf_activation_name_both_ways():
    spec = config_to_spec({**LLAMA, "hidden_act": "relu2"})
    act = spec.layer(0).ffn.activation
    assert act.name == "relu2"
    x = torch.linspace(-2, 2, 9)
    torch.testing.assert_close(act.build()(x), torch.relu(x) ** 2)
    assert activation_name(act) == "relu2"
    assert zoo.checkpoints.spec_to_config(spec, "llama")["hidden_act"] == "relu2"


def test_relu2_checkpoint_matches_transformers(tmp_path):
    tiny = pytest.importorskip("zoo.checkpoints.tiny")
    pytest.importorskip("transformers")
    tiny.make_tiny("llama", tmp_path, overrides={"hidden_act": "relu2"})
    report = zoo.verify(tmp_path)
    assert report.passed, report.summary()


class Cube(nn.Module):
    """x ** 3, named "cube" in HF configs."""

    @dataclass(frozen=True)
    class Config:
        pass

    hf_names = {"cube": {}}

    def __init__(self, cfg=None):
        super().__init__()

    def forward(self, x):
        return x ** 3


@pytest.fixture
def cube():
    m = zoo.manager()
    m.add("activation", "zt_cube", Cube, provider="zt-test")
    yield
    m.registry("activation").remove("zt_cube", "zt-test")


def test_a_plugins_activation_names_itself_in_configs(cube):
    spec = config_to_spec({**LLAMA, "hidden_act": "cube"})
    assert spec.layer(0).ffn.activation.name == "zt_cube"
    assert zoo.checkpoints.spec_to_config(spec, "llama")["hidden_act"] == "cube"


def test_a_format_adds_its_own_activation_names():
    f = Fields({"hidden_act": "quick_gelu"}, "mine")
    with pytest.raises(ConfigError, match="activation 'quick_gelu' is not supported"):
        activation(f, "hidden_act", "gelu")
    extra = {"quick_gelu": {"name": "gelu", "approximate": "tanh"}}
    part = activation(f, "hidden_act", "gelu", extra=extra)
    assert part == {"name": "gelu", "approximate": "tanh"}
    spec = zoo.get_spec("llama3-8b", {"layers.*.ffn.activation": part})
    assert activation_name(spec.layer(0).ffn.activation, extra={"quick_tanh": part}) == "gelu_pytorch_tanh"


def test_a_save_mismatch_names_the_differing_fields(tmp_path):
    model = zoo.build("llama3-8b", device="meta", overrides={**SMALL, "head.softcap": 30.0,
                                                            "layers.*.mixer.softcap": 50.0})
    with pytest.raises(CheckpointError) as err:
        zoo.save_pretrained(model, tmp_path / "out", model_type="llama")
    message = str(err.value)
    assert "head.softcap: 30.0 in the model, null as the config reads back" in message
    assert "per_layer[0].mixer.softcap: 50.0 in the model, null as the config reads back" in message


def test_zoo_list_kind_name_shows_a_parts_settings_types_and_defaults(capsys):
    assert main(["list", "ffn", "swiglu"]) == 0
    out = capsys.readouterr().out
    assert "GLU with SiLU" in out  # the part's own description
    assert re.search(r"d_ff_rule\s+Literal\['4x', '8/3', '8/3_scaled'\]\s+= '8/3'", out)
    assert re.search(r"activation\s+activation part\s+= 'silu'", out)
    assert main(["list", "mixer", "attention", "--json"]) == 0
    (row,) = json.loads(capsys.readouterr().out)
    settings = {s["name"]: s for s in row["settings"]}
    assert settings["n_heads"] == {"name": "n_heads", "type": "int", "default": "(required)"}
    assert settings["window"] == {"name": "window", "type": "Optional[int]", "default": None}
    assert main(["list", "ffn", "swi*"]) == 0  # a pattern lists names only
    assert "d_ff_rule" not in capsys.readouterr().out


def test_every_part_with_settings_describes_itself():
    from zoo.commands.list import describe

    undocumented = [(kind, name) for kind, names in zoo.list_components().items() for name in names
                    if hasattr(zoo.get(kind, name), "Config") and not describe(zoo.get(kind, name))]
    assert not undocumented, f"parts without a docstring of their own (zoo list KIND NAME shows it): {undocumented}"


def test_zoo_testing_examples_run():
    pytest.importorskip("zoo_alibi_dyt")
    calls = re.findall(r"zoo\.testing\.(check\(.*?\))  #", zt.__doc__)
    assert calls == ['check("norm", "dyt", {"alpha_init": 1.0})']
    eval(calls[0], {"check": zt.check})
    example = re.search(r"``(part\(.*?\))``", zt.part.__doc__).group(1)
    norm = eval(example, {"part": zt.part})
    assert norm(torch.randn(2, 64)).shape == (2, 64)
    example = re.search(r"``(tiny_model\(.*?\))``", zt.tiny_model.__doc__).group(1)
    model = eval(example, {"tiny_model": zt.tiny_model, "tiny_spec_with": zt.tiny_spec_with})
    assert type(model.layers[0].attn_norm).__name__ == "DyT"

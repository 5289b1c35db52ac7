"""Hostile LoRA adapter directories: every adapter_config.json setting is checked as PEFT's LoraConfig
would have it, with the file and field named; the rank comes from lora_A's shape and a differing ``r``
is refused before peft allocates anything; ``target_modules`` is honoured as PEFT honours it."""

import copy
import json

import pytest
import torch
from safetensors.torch import load_file, save_file

import zoo
from zoo.checkpoints import adapter
from zoo.checkpoints.hf.format import CheckpointError
from zoo.checkpoints.tiny import make_tiny

peft = pytest.importorskip("peft")

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """A tiny Llama written by transformers and a rank-4 PEFT adapter on its q_proj and v_proj."""
    d = tmp_path_factory.mktemp("adapters")
    hf = make_tiny("llama", d / "base", std=0.1, overrides={"vocab_size": 256})
    model = peft.get_peft_model(copy.deepcopy(hf), peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    for n, p in model.named_parameters():
        if "lora_B" in n:
            torch.nn.init.normal_(p, std=0.1, generator=torch.Generator().manual_seed(0))
    model.save_pretrained(d / "adapter")
    return d / "base", d / "adapter"


def variant(pair, tmp_path, *, config=None, drop=(), add=None):
    """A copy of the adapter with ``config`` fields set, the tensors whose names contain any of ``drop``
    left out, and the tensors ``add`` added."""
    src = pair[1]
    out = tmp_path / "adapter"
    out.mkdir()
    cfg = json.loads((src / adapter.CONFIG_FILE).read_text())
    (out / adapter.CONFIG_FILE).write_text(json.dumps({**cfg, **(config or {})}))
    tensors = {k: v for k, v in load_file(src / adapter.WEIGHTS_FILE).items() if not any(d in k for d in drop)}
    save_file({**tensors, **(add or {})}, out / adapter.WEIGHTS_FILE)
    return out


def test_an_adapter_rank_of_fifty_million_is_refused_before_peft_allocates(pair, tmp_path, monkeypatch):
    """r = 50,000,000 over rank-4 tensors once asked peft for 12.8 GB before the shapes were compared."""
    path = variant(pair, tmp_path, config={"r": 50_000_000})
    monkeypatch.setattr(adapter, "add_lora", lambda *a, **k: pytest.fail("peft was asked for the config's rank"))
    with pytest.raises(CheckpointError, match=r"adapter_config\.json: r = 50000000, but the lora_A tensors of "
                                              r"adapter_model\.safetensors have rank 4"):
        zoo.from_pretrained(pair[0], adapter=path)


@pytest.mark.parametrize("field, value, must", [
    ("lora_alpha", float("nan"), "a positive finite number"), ("lora_alpha", float("inf"), "a positive finite number"),
    ("lora_alpha", 0, "a positive finite number"), ("lora_alpha", -8, "a positive finite number"),
    ("lora_alpha", "8", "a positive finite number"),
    ("r", "abc", "a positive integer"), ("r", 0, "a positive integer"), ("r", 2.5, "a positive integer"),
    ("r", True, "a positive integer"),
    ("lora_dropout", 5, r"a number in \[0, 1\)"), ("lora_dropout", 1.0, r"a number in \[0, 1\)"),
    ("lora_dropout", -0.1, r"a number in \[0, 1\)"),
    ("use_rslora", "no", "true or false"), ("use_rslora", 1, "true or false"),
    ("target_modules", [1, 2], "a list of module names"), ("target_modules", 5, "a list of module names"),
    ("target_modules", "(", "a regular expression"),
])
def test_every_adapter_setting_is_checked_naming_the_file_and_field(pair, tmp_path, field, value, must):
    path = variant(pair, tmp_path, config={field: value})
    with pytest.raises(CheckpointError, match=rf"adapter_config\.json: {field} = .*: must be {must}"):
        zoo.from_pretrained(pair[0], adapter=path)


def test_tensors_of_modules_target_modules_does_not_name_are_refused(pair, tmp_path):
    """PEFT applies only what target_modules names (it ignores the file's other tensors); zoo once wrapped
    every module the file had tensors for, and so computed another model."""
    path = variant(pair, tmp_path, config={"target_modules": ["q_proj"]})
    with pytest.raises(CheckpointError, match=r"tensor 'base_model\.model\.model\.layers\.0\.self_attn\.v_proj\.lora_A"
                                              r"\.weight' is for model\.layers\.0\.self_attn\.v_proj, which "
                                              r"adapter_config\.json's target_modules \['q_proj'\] does not name"):
        zoo.from_pretrained(pair[0], adapter=path)


def test_target_modules_as_a_regular_expression_is_matched_as_peft_matches_it(pair, tmp_path):
    both = zoo.from_pretrained(pair[0], adapter=pair[1], progress=False)
    regex = variant(pair, tmp_path, config={"target_modules": r".*\.(q|v)_proj"})
    assert set(adapter.lora_layers(zoo.from_pretrained(pair[0], adapter=regex, progress=False))) == \
        set(adapter.lora_layers(both))
    (tmp_path / "adapter" / adapter.CONFIG_FILE).write_text(json.dumps(
        {**json.loads((pair[1] / adapter.CONFIG_FILE).read_text()), "target_modules": r"q_proj"}))  # fullmatch: no module
    with pytest.raises(CheckpointError, match=r"target_modules 'q_proj' does not name"):
        zoo.from_pretrained(pair[0], adapter=regex)


def test_lora_tensors_on_the_embedding_are_refused_naming_the_adapter_file(pair, tmp_path):
    path = variant(pair, tmp_path, add={"base_model.model.model.embed_tokens.lora_A.weight": torch.zeros(4, 256),
                                        "base_model.model.model.embed_tokens.lora_B.weight": torch.zeros(64, 4)})
    with pytest.raises(CheckpointError, match=r"adapter_model\.safetensors: tensor 'base_model\.model\.model\."
                                              r"embed_tokens\.lora_[AB]\.weight' is for no linear module"):
        zoo.from_pretrained(pair[0], adapter=path)


def test_lora_tensors_of_two_ranks_are_refused(pair, tmp_path):
    key = "base_model.model.model.layers.0.self_attn.q_proj"
    path = variant(pair, tmp_path, add={f"{key}.lora_A.weight": torch.zeros(2, 64), f"{key}.lora_B.weight": torch.zeros(96, 2)})
    with pytest.raises(CheckpointError, match=r"lora_A tensors have ranks \[2, 4\]"):
        zoo.from_pretrained(pair[0], adapter=path)

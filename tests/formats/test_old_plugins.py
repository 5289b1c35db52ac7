"""Plugins of the last release keep working: a block of a plugin's own that stores its mixer as
``self.attention`` (zoo 0.2's block API; tests/own_block_plugin.py) keeps its parameter names, and its
checkpoints load and save, through its format and through a training checkpoint of the earlier layout.
The rename of zoo 0.1's ``layers.{i}.attention.*`` to ``layers.{i}.mixer.*`` applies only where the
model has the new name."""

import warnings

import pytest
import torch
from safetensors.torch import save_file

import zoo
from hf_pairs import assert_same_model
from zoo.checkpoints.hf.maps import bind, rule

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def plugin():
    info = zoo.load_plugin("own_block_plugin")
    assert info.error is None, info.error
    import own_block_plugin

    return own_block_plugin


def tiny(plugin, seed=0):
    return zoo.build_model(plugin.OwnBlock().config_to_spec(plugin.OwnBlock.tiny), seed=seed).eval()


@torch.no_grad()
def test_a_plugin_block_keeping_attention_saves_and_loads_its_checkpoints(plugin, tmp_path):
    model = tiny(plugin, seed=1)
    assert "layers.0.attention.q_proj.weight" in model.state_dict()
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)  # it uses no deprecated name: nothing warns
        zoo.save_pretrained(model, tmp_path / "ckpt", model_type="own-block")
        loaded = zoo.from_pretrained(tmp_path / "ckpt")
    assert_same_model(model, loaded, 64)


def test_an_old_mixer_name_is_renamed_only_where_the_model_has_the_new_one(plugin):
    old = [rule("model.layers.{i}.self_attn.q_proj.weight", "layers.{i}.attention.q_proj.weight")]
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)
        own = [b.zoo for b in bind(old, tiny(plugin))]
    assert own == [("layers.0.attention.q_proj.weight",), ("layers.1.attention.q_proj.weight",)]
    ours = zoo.build_model(zoo.get_spec("llama3-8b", n_layers=2, d_model=32, vocab_size=64, overrides={
        "layers.*.mixer.n_heads": 4, "layers.*.mixer.n_kv_heads": 2, "layers.*.ffn.d_ff": 48}), seed=0)
    with pytest.warns(DeprecationWarning, match=r"layers.\{i\}.attention.\* is deprecated .* use layers.\{i\}.mixer.\*"):
        renamed = [b.zoo for b in bind(old, ours)]
    assert renamed == [("layers.0.mixer.q_proj.weight",), ("layers.1.mixer.q_proj.weight",)]


@torch.no_grad()
def test_a_training_checkpoint_of_the_earlier_layout_resumes_into_a_block_keeping_attention(plugin, tmp_path):
    from accelerate import Accelerator
    from zoo.training.checkpointer import Checkpointer

    model, target = tiny(plugin, seed=1), tiny(plugin, seed=2)
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(tmp_path / "model.safetensors"))
    optimizer = torch.optim.AdamW(target.parameters())
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    save_file({}, str(tmp_path / "optimizer.safetensors"))
    state = {"format": 1, "sharded": False,
             "optimizer": {"state_keys": {}, "param_groups": optimizer.state_dict()["param_groups"]},
             "scheduler": scheduler.state_dict()}
    Checkpointer(Accelerator(cpu=True), tmp_path, keep_last=1).load(tmp_path, state, model=target, optimizer=optimizer,
                                                                     scheduler=scheduler)
    for k, v in model.state_dict().items():
        assert torch.equal(target.state_dict()[k], v), k

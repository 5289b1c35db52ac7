"""Loading and saving checkpoints: layouts, bad input, atomic saves, the hub cache, strict configs.
These build their checkpoints with zoo itself, so they do not need transformers."""

import json
import os

import pytest
import torch
from safetensors.torch import load_file, save_file

import zoo
from zoo.checkpoints import CheckpointError, ConfigError, config_to_spec

TINY = {"model_type": "llama", "vocab_size": 96, "hidden_size": 32, "intermediate_size": 48,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 12,
        "max_position_embeddings": 64, "rms_norm_eps": 1e-5, "tie_word_embeddings": False,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}}


@pytest.fixture
def ckpt(tmp_path):
    """A small llama checkpoint written by zoo (single file), and the model it came from."""
    model = zoo.build_model(config_to_spec(TINY), seed=0)
    d = tmp_path / "ckpt"
    zoo.save_pretrained(model, d, model_type="llama")
    return d, model


def same_weights(a, b):
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


def test_save_writes_hf_layout_and_loads_back(ckpt):
    d, model = ckpt
    config = json.loads((d / "config.json").read_text())
    assert config["model_type"] == "llama" and config["architectures"] == ["LlamaForCausalLM"]
    assert sorted(os.listdir(d)) == ["config.json", "model.safetensors"]
    names = set(load_file(d / "model.safetensors"))
    assert "model.layers.1.self_attn.k_proj.weight" in names and "lm_head.weight" in names
    loaded = zoo.from_pretrained(d)
    assert same_weights(model, loaded)
    assert not any(p.is_meta for p in loaded.parameters())
    ids = torch.randint(0, 96, (1, 10))
    with torch.no_grad():
        assert torch.equal(model.eval()(ids), loaded(ids))


def test_fields_transformers_ignores_are_kept_through_load_and_save(ckpt, tmp_path):
    d, model = ckpt
    config = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**config, "is_llama_config": True, "rope_interleaved": False}))
    loaded = zoo.from_pretrained(d)
    assert loaded.hf_config["is_llama_config"] is True and loaded.hf_config["rope_interleaved"] is False
    zoo.save_pretrained(loaded, tmp_path / "again")
    saved = json.loads((tmp_path / "again" / "config.json").read_text())
    assert saved["is_llama_config"] is True and saved["rope_interleaved"] is False
    with pytest.raises(ConfigError, match="'is_llama_config'"):
        zoo.from_pretrained(d, strict=True)
    # Saved as another model_type, they are not carried: that format may read a field of that name.
    zoo.save_pretrained(loaded, tmp_path / "as-mistral", model_type="mistral")
    assert "is_llama_config" not in json.loads((tmp_path / "as-mistral" / "config.json").read_text())


def test_sharded_and_dtype(ckpt, tmp_path):
    _, model = ckpt
    zoo.save_pretrained(model, tmp_path / "sharded", model_type="llama", max_shard_size="10KB")
    index = json.loads((tmp_path / "sharded" / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 2
    loaded = zoo.from_pretrained(tmp_path / "sharded", dtype=torch.bfloat16)
    assert all(p.dtype == torch.bfloat16 for p in loaded.parameters())
    ref = {k: v.to(torch.bfloat16) for k, v in model.state_dict().items()}
    assert all(torch.equal(ref[k], v) for k, v in loaded.state_dict().items())


def test_tied_head_stored_or_not(ckpt, tmp_path):
    d, _ = ckpt
    config = {**json.loads((d / "config.json").read_text()), "tie_word_embeddings": True}
    tensors = load_file(d / "model.safetensors")
    tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"].clone()  # a stored tied copy
    for name, keep_head in (("with", True), ("without", False)):
        out = tmp_path / name
        out.mkdir()
        (out / "config.json").write_text(json.dumps(config))
        save_file({k: v for k, v in tensors.items() if keep_head or k != "lm_head.weight"}, out / "model.safetensors")
        model = zoo.from_pretrained(out)
        assert model.lm_head is None and torch.equal(model.embed.weight, tensors["model.embed_tokens.weight"])


def rewrite(d, fn):
    tensors = load_file(d / "model.safetensors")
    fn(tensors)
    save_file(tensors, d / "model.safetensors")


def test_missing_tensor(ckpt):
    d, _ = ckpt
    rewrite(d, lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))
    with pytest.raises(CheckpointError, match=r"model\.layers\.1\.mlp\.up_proj\.weight.*missing"):
        zoo.from_pretrained(d)


def test_unexpected_tensor(ckpt):
    d, _ = ckpt
    rewrite(d, lambda t: t.update({"model.layers.0.mlp.extra.weight": torch.zeros(2)}))
    with pytest.raises(CheckpointError, match=r"unexpected tensor 'model\.layers\.0\.mlp\.extra\.weight'"):
        zoo.from_pretrained(d)


def test_wrong_shape(ckpt):
    d, _ = ckpt
    rewrite(d, lambda t: t.update({"model.norm.weight": torch.ones(31)}))
    with pytest.raises(CheckpointError, match=r"'model\.norm\.weight' \(31,\) gives final_norm\.weight the shape \(31,\), but it needs \(32,\)"):
        zoo.from_pretrained(d)


def test_truncated_and_corrupt_files(ckpt):
    d, _ = ckpt
    path = d / "model.safetensors"
    data = path.read_bytes()
    path.write_bytes(data[:-100])
    with pytest.raises(CheckpointError, match="model.safetensors: truncated"):
        zoo.from_pretrained(d)
    path.write_bytes(data[:8] + b"{not json" + data[17:])
    with pytest.raises(CheckpointError, match="model.safetensors: corrupt"):
        zoo.from_pretrained(d)


def test_missing_shard(ckpt, tmp_path):
    _, model = ckpt
    out = tmp_path / "sharded"
    zoo.save_pretrained(model, out, model_type="llama", max_shard_size="10KB")
    (out / "model-00002-of-{:05d}.safetensors".format(len(list(out.glob("model-*"))))).unlink()
    with pytest.raises(CheckpointError, match=r"lists shard 'model-00002-of-\d+\.safetensors', which is missing"):
        zoo.from_pretrained(out)


def test_pickle_refused(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(TINY))
    (tmp_path / "pytorch_model.bin").write_bytes(b"not to be unpickled")
    with pytest.raises(CheckpointError, match="never unpickles"):
        zoo.from_pretrained(tmp_path)


def test_unsupported_model_type_and_fields():
    with pytest.raises(CheckpointError, match="unsupported model_type 'mamba'.*Supported: .*llama"):
        config_to_spec({**TINY, "model_type": "mamba"})
    bad_rope = {**TINY, "rope_parameters": {"rope_type": "longrope", "rope_theta": 1e4}}
    with pytest.raises(ConfigError, match=r"'rope_parameters\.rope_type'.*longrope"):
        config_to_spec(bad_rope)
    for quant in ({"quant_method": "gptq"}, {}):  # transformers' loader acts on it for any model_type
        with pytest.raises(ConfigError, match=r"'quantization_config\.quant_method'.*quantiz"):
            config_to_spec({**TINY, "quantization_config": quant})
    # A field transformers does not read changes nothing: accepted, unless asked to be strict.
    assert config_to_spec({**TINY, "vendor_note": 1}).d_model == 32
    with pytest.raises(ConfigError, match="'vendor_note'.*does not read"):
        config_to_spec({**TINY, "vendor_note": 1}, strict=True)
    with pytest.raises(ConfigError, match="'hidden_act'.*'tanh'"):
        config_to_spec({**TINY, "hidden_act": "tanh"})


def test_old_style_rope_fields():
    spec = config_to_spec({**{k: v for k, v in TINY.items() if k != "rope_parameters"}, "rope_theta": 5e5,
                           "rope_scaling": {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                                            "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}})
    assert spec.position.theta == 5e5
    assert spec.position.scaling.name == "llama3" and spec.position.scaling.factor == 32.0


def test_save_is_atomic(ckpt, monkeypatch):
    d, model = ckpt
    before = {p.name: p.read_bytes() for p in d.iterdir()}
    (d / "tokenizer.json").write_text("{}")
    other = zoo.build_model(model.spec, seed=1)

    def boom(*a, **k):
        raise OSError("disk full")

    monkeypatch.setattr("zoo.checkpoints.files.io.create_shard", boom)
    with pytest.raises(OSError, match="disk full"):
        zoo.save_pretrained(other, d, model_type="llama")
    assert {p.name: p.read_bytes() for p in d.iterdir() if p.name != "tokenizer.json"} == before
    assert [p.name for p in d.parent.iterdir() if p.name.startswith(".")] == []
    monkeypatch.undo()
    zoo.save_pretrained(other, d, model_type="llama")
    assert (d / "tokenizer.json").read_text() == "{}"  # carried over
    assert same_weights(other, zoo.from_pretrained(d))


def test_save_needs_model_type_and_an_expressible_model():
    model = zoo.build("mistral-7b", device="meta", n_layers=1, d_model=32, vocab_size=64,
                      overrides={"layers.*.mixer.n_heads": 4, "layers.*.mixer.n_kv_heads": 2,
                                 "layers.*.ffn.d_ff": 48, "layers.*.mixer.window": 8})
    with pytest.raises(CheckpointError, match="pass model_type="):
        zoo.save_pretrained(model, "unused")
    with pytest.raises(CheckpointError, match="cannot be written as llama.*sliding"):
        zoo.save_pretrained(model, "unused", model_type="llama")


def hub_cache(root, repo, files_from, commit="0123456789abcdef0123456789abcdef01234567", ref="main"):
    """The huggingface_hub cache layout: refs/<ref> -> snapshots/<commit>/files."""
    folder = root / ("models--" + repo.replace("/", "--"))
    (folder / "refs").mkdir(parents=True, exist_ok=True)
    (folder / "refs" / ref).write_text(commit)
    snap = folder / "snapshots" / commit
    snap.mkdir(parents=True)
    for p in files_from.iterdir():
        (snap / p.name).write_bytes(p.read_bytes())
    return snap


def test_hub_repo_from_offline_cache(ckpt, tmp_path, monkeypatch):
    import huggingface_hub.constants as C

    d, model = ckpt
    cache = tmp_path / "hub"
    hub_cache(cache, "someone/tiny-llama", d)
    monkeypatch.setattr(C, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(C, "HF_HUB_OFFLINE", True)
    assert same_weights(model, zoo.from_pretrained("someone/tiny-llama"))
    other = zoo.build_model(model.spec, seed=3)
    zoo.save_pretrained(other, tmp_path / "v2", model_type="llama")
    hub_cache(cache, "someone/tiny-llama", tmp_path / "v2", commit="f" * 40, ref="v2")
    assert same_weights(other, zoo.from_pretrained("someone/tiny-llama", revision="v2"))
    with pytest.raises(CheckpointError, match="not in the Hugging Face cache.*offline"):
        zoo.from_pretrained("someone/not-cached")


def test_real_world_config_spellings():
    # Gemma's official configs say "gelu" and mean the tanh approximation.
    gemma = {**TINY, "model_type": "gemma", "hidden_act": "gelu", "hidden_activation": None}
    assert config_to_spec(gemma).layer(0).ffn.activation.approximate == "tanh"
    # GPT-2's config.json carries n_ctx; GPT-J's carries rotary and scale_attn_weights.
    gpt2 = {"model_type": "gpt2", "vocab_size": 64, "n_embd": 32, "n_layer": 1, "n_head": 4, "n_positions": 16,
            "n_ctx": 16, "summary_type": "cls_index", "task_specific_params": {"text-generation": {}}}
    assert config_to_spec(gpt2).max_seq_len == 16
    gptj = {"model_type": "gptj", "vocab_size": 64, "n_embd": 32, "n_layer": 1, "n_head": 4, "n_positions": 16,
            "rotary": True, "scale_attn_weights": True, "rotary_dim": 4}
    assert config_to_spec(gptj).position.rotary_dim == 4
    with pytest.raises(ConfigError, match="'rotary'"):
        config_to_spec({**gptj, "rotary": False})
    falcon = {"model_type": "falcon", "vocab_size": 64, "hidden_size": 32, "n_layer": 1, "n_head": 4,
              "alibi": False, "multi_query": True, "apply_residual_connection_post_layernorm": False}
    assert config_to_spec(falcon).layer(0).mixer.n_kv_heads == 1
    with pytest.raises(ConfigError, match="'alibi'.*ALiBi"):
        config_to_spec({**falcon, "alibi": True})


def test_formats_are_registry_parts():
    assert {"llama", "gemma3", "gpt2", "falcon"} <= set(zoo.list_components("checkpoint_format"))
    assert zoo.manager().provider_of("checkpoint_format", "qwen3") == "zoo.checkpoints.hf.formats"
    with pytest.raises(zoo.RegistryError, match="needs a `config_to_spec` method"):
        zoo.manager().add("checkpoint_format", "broken", object(), provider="test")


def test_a_format_that_cannot_describe_the_model_says_so(tmp_path):
    # GPT-3's learned positions have no RoPE base for the llama format to write.
    model = zoo.build("gpt3-125m", n_layers=1, d_model=32, vocab_size=64, max_seq_len=16,
                      overrides={"layers.*.mixer.n_heads": 2, "layers.*.mixer.head_dim": 16}, seed=0)
    for model_type in zoo.list_components("checkpoint_format"):
        if model_type == "gpt2":
            continue
        with pytest.raises(CheckpointError, match=f"cannot be written as {model_type}"):
            zoo.save_pretrained(model, tmp_path / model_type, model_type=model_type)
        assert not (tmp_path / model_type).exists()
    zoo.save_pretrained(model, tmp_path / "gpt2", model_type="gpt2")
    assert (tmp_path / "gpt2" / "config.json").exists()

"""Parity with the transformers reference: for every supported model_type, a tiny random model
saved by transformers, loaded by zoo, gives the same fp32 logits (also with left padding), and
zoo's own save loads back into transformers with the same logits."""

import pytest
import torch

import zoo
from zoo.checkpoints.tiny import make_tiny, tiny_formats

pytest.importorskip("transformers")

ATOL = 1e-4
SEQ = 32  # longer than the tiny sliding windows (8)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    made = {}

    def get(model_type, **overrides):
        key = (model_type, tuple(sorted((k, repr(v)) for k, v in overrides.items())))
        if key not in made:
            d = tmp_path_factory.mktemp(model_type)
            made[key] = (d, make_tiny(model_type, d, overrides=overrides))
        return made[key]

    return get


def padded_batch(vocab, seq=SEQ, pad=5):
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, vocab, (2, seq), generator=gen)
    mask = torch.ones(2, seq, dtype=torch.long)
    mask[1, :pad] = 0
    position_ids = (mask.cumsum(-1) - 1).clamp(min=0)
    return ids, mask, position_ids


def assert_parity(hf, model, vocab):
    ids, mask, pos = padded_batch(vocab)
    with torch.no_grad():
        ref = hf(ids[:1]).logits
        out = model(ids[:1])
        torch.testing.assert_close(out, ref, atol=ATOL, rtol=0)
        ref = hf(ids, attention_mask=mask, position_ids=pos).logits
        out = model(ids, attention_mask=mask, position_ids=pos)
    real = mask.bool()
    torch.testing.assert_close(out[real], ref[real], atol=ATOL, rtol=0)
    return ref


@pytest.mark.parametrize("model_type", tiny_formats())
def test_transformers_save_zoo_load(model_type, tiny_dir):
    d, hf = tiny_dir(model_type)
    model = zoo.from_pretrained(d)
    assert model.checkpoint_format == model_type
    ref = assert_parity(hf, model, hf.config.get_text_config().vocab_size)
    assert ref.abs().max() > 1.0  # the logits are not trivially flat


@pytest.mark.parametrize("model_type", tiny_formats())
def test_zoo_save_transformers_load(model_type, tiny_dir, tmp_path):
    import transformers

    d, hf = tiny_dir(model_type)
    model = zoo.from_pretrained(d)
    zoo.save_pretrained(model, tmp_path / "out", max_shard_size=40_000)
    assert (tmp_path / "out" / "model.safetensors.index.json").is_file()
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out", attn_implementation="eager")
    ids, _, _ = padded_batch(hf.config.vocab_size)
    with torch.no_grad():
        torch.testing.assert_close(back(ids).logits, hf(ids).logits, atol=0, rtol=0)
    again = zoo.from_pretrained(tmp_path / "out")
    a, b = model.state_dict(), again.state_dict()
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)


ROPE_SCALINGS = {
    "linear": {"rope_type": "linear", "factor": 4.0},
    "dynamic": {"rope_type": "dynamic", "factor": 2.0},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16, "beta_fast": 16.0},
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8},
}


@pytest.mark.parametrize("scaling", sorted(ROPE_SCALINGS))
def test_rope_scalings(scaling, tiny_dir):
    # max_position_embeddings below the sequence length, so dynamic NTK actually rescales.
    params = {"rope_theta": 5000.0, **ROPE_SCALINGS[scaling]}
    d, hf = tiny_dir("llama", rope_parameters=params, max_position_embeddings=16)
    model = zoo.from_pretrained(d)
    assert model.spec.position.scaling is not None
    assert_parity(hf, model, 128)


def test_softcaps_are_reached(tiny_dir):
    """The tiny Gemma 2 has caps small enough that they change the result: without them zoo differs."""
    d, hf = tiny_dir("gemma2")
    model = zoo.from_pretrained(d)
    uncapped = zoo.build_model(model.spec.with_overrides({"layers.*.attention.softcap": None, "head.softcap": None}),
                               device="meta")
    uncapped.load_state_dict(model.state_dict(), assign=True)
    ids, _, _ = padded_batch(128)
    with torch.no_grad():
        ref = hf(ids).logits
        assert (uncapped(ids) - ref).abs().max() > 0.1
        assert (model(ids) - ref).abs().max() < ATOL
    assert ref.abs().max() < hf.config.final_logit_softcapping


def test_gemma3_multimodal_checkpoint_text_part(tiny_dir, tmp_path):
    """A gemma3 checkpoint keeps its text model under text_config and language_model.* tensors."""
    import json

    from safetensors.torch import load_file, save_file

    d, hf = tiny_dir("gemma3_text")
    text = json.loads((d / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gemma3", "text_config": text,
                                                      "architectures": ["Gemma3ForConditionalGeneration"]}))
    tensors = {("language_model." + k): v for k, v in load_file(d / "model.safetensors").items()}
    tensors["vision_tower.vision_model.embeddings.patch_embedding.weight"] = torch.zeros(4, 3, 2, 2)
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    model = zoo.from_pretrained(tmp_path)
    assert_parity(hf, model, 128)

"""Parity with the transformers reference (pinned in pyproject.toml).

For every model_type zoo ships (an installed plugin's formats are its own tests' business), a tiny random model made and saved by transformers (the format's
``tiny`` config: GQA, head_dim != d_model / heads, sliding windows shorter than the sequence,
QKV biases, soft-caps, and between them all four RoPE scalings: llama3 on llama, yarn on qwen2,
linear on qwen3, dynamic on gemma), loaded by zoo, gives float32 logits no further from transformers'
float64 run than twice transformers' own float32 logits are (plus 1e-5), also for a left-padded batch. Then zoo saves it and transformers loads zoo's files into the very same
weights and logits, and zoo loads its own save bit for bit.
"""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

import zoo
from zoo.checkpoints.tiny import make_tiny, tiny_formats

from hf_pairs import assert_within_reference_error, float64_twin, own_tiny_formats

pytestmark = pytest.mark.parity  # compared with transformers in float32: the README's test command runs these at 1 and 2 threads

transformers = pytest.importorskip("transformers")

ATOL = 1e-4  # transformers against itself, on the same weights read back from zoo's files
SEQ, PAD = 32, 5  # longer than the tiny sliding windows (8)


def batch(vocab=128):
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, vocab, (2, SEQ), generator=gen)
    mask = torch.ones(2, SEQ, dtype=torch.long)
    mask[1, :PAD] = 0  # left padding
    return ids, mask, (mask.cumsum(-1) - 1).clamp(min=0)


def reference(hf):
    ids, mask, pos = batch()
    with torch.no_grad():
        return hf(ids, attention_mask=mask, position_ids=pos).logits


def exact_reference(hf):
    """transformers' logits at the real tokens of :func:`batch`, in float64, each row run alone
    without padding (a float64 run of a padded batch can turn the fully masked rows into NaN)."""
    twin, (ids, mask, _) = float64_twin(hf), batch()
    with torch.no_grad():
        return torch.cat([twin(row[keep.bool()][None]).logits[0] for row, keep in zip(ids, mask)])


def assert_parity(model, ref, exact):
    """``ref``: transformers' float32 logits of :func:`batch`; ``exact``: :func:`exact_reference`."""
    ids, mask, pos = batch()
    with torch.no_grad():
        alone = model(ids[:1])  # no mask: the fast unmasked path
        padded = model(ids, attention_mask=mask, position_ids=pos)
    assert_within_reference_error(alone[0], ref[0], exact[:SEQ], what="unpadded row")
    real = mask.bool()  # padding positions are not compared
    assert_within_reference_error(padded[real], ref[real], exact, what="left-padded batch")


def check(model_type, overrides, tmp_path):
    hf = make_tiny(model_type, tmp_path / "hf", overrides=overrides)
    ref, exact = reference(hf), exact_reference(hf)
    assert ref.abs().max() > 1.0  # the logits are not trivially flat

    model = zoo.from_pretrained(tmp_path / "hf")
    assert model.checkpoint_format == model_type
    assert_parity(model, ref, exact)

    zoo.save_pretrained(model, tmp_path / "zoo", max_shard_size=40_000)
    assert (tmp_path / "zoo" / "model.safetensors.index.json").is_file()
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "zoo", attn_implementation="eager")
    a, b = back.state_dict(), hf.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    torch.testing.assert_close(reference(back), ref, atol=ATOL, rtol=0)

    again = zoo.from_pretrained(tmp_path / "zoo")
    a, b = model.state_dict(), again.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    return hf, model, ref


VARIANTS = [
    *[(m, {}) for m in own_tiny_formats()],
    ("falcon", {"new_decoder_architecture": False, "multi_query": True, "num_kv_heads": None}),
    ("falcon", {"new_decoder_architecture": False, "multi_query": False, "num_kv_heads": 4}),
    ("falcon", {"new_decoder_architecture": False, "multi_query": False, "num_kv_heads": 4, "parallel_attn": False}),
    ("falcon", {"num_ln_in_parallel_attn": 1, "bias": False, "tie_word_embeddings": False}),
    ("gpt_neox", {"use_parallel_residual": False, "attention_bias": False}),
    ("gpt2", {"scale_attn_weights": False, "tie_word_embeddings": False}),
    ("gptj", {"tie_word_embeddings": True}),
    ("mistral", {"sliding_window": None, "tie_word_embeddings": True}),
    ("llama", {"attention_bias": True, "mlp_bias": True, "max_position_embeddings": 16,
               "rope_parameters": {"rope_type": "dynamic", "rope_theta": 5e5, "factor": 3.0}}),
]


def test_the_sweep_takes_zoos_formats_only():
    """A format a plugin registers in this process (the toy plugin's ``toy-hybrid``, which has a
    tiny config) is not swept here, while every format zoo ships is."""
    assert zoo.load_plugin("toy_plugin").error is None
    assert "toy-hybrid" in tiny_formats() and "toy-hybrid" not in own_tiny_formats()
    swept = {m for m, _ in VARIANTS}
    assert swept == set(own_tiny_formats()) and {"llama", "qwen3_next", "gemma2"} <= swept


@pytest.mark.parametrize("model_type,overrides", VARIANTS,
                         ids=[m + ("" if not o else f"-{i}") for i, (m, o) in enumerate(VARIANTS)])
def test_parity_and_round_trip(model_type, overrides, tmp_path):
    check(model_type, overrides, tmp_path)


def test_softcaps_are_reached(tmp_path):
    """The tiny Gemma 2's caps change the result: without them zoo would not match."""
    hf, model, ref = check("gemma2", {}, tmp_path)
    spec = model.spec.with_overrides({"layers.*.mixer.softcap": None, "head.softcap": None})
    uncapped = zoo.build_model(spec, device="meta")
    uncapped.load_state_dict(model.state_dict(), assign=True)
    ids, _, _ = batch()
    with torch.no_grad():
        assert (uncapped(ids[:1])[0] - ref[0]).abs().max() > 0.1
        assert (uncapped(ids[:1]) - model(ids[:1])).abs().max() > 0.1


def test_gemma3_multimodal_checkpoint_text_part(tmp_path):
    """A gemma3 checkpoint keeps its text model under text_config and language_model.* tensors."""
    hf = make_tiny("gemma3_text", tmp_path / "text")
    text = json.loads((tmp_path / "text" / "config.json").read_text())
    out = tmp_path / "mm"
    out.mkdir()
    (out / "config.json").write_text(json.dumps({"model_type": "gemma3", "text_config": text,
                                                 "architectures": ["Gemma3ForConditionalGeneration"]}))
    tensors = {"language_model." + k: v for k, v in load_file(tmp_path / "text" / "model.safetensors").items()}
    tensors["vision_tower.vision_model.embeddings.patch_embedding.weight"] = torch.zeros(4, 3, 2, 2)
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    assert_parity(zoo.from_pretrained(out), reference(hf), exact_reference(hf))


def test_base_model_names_without_prefix(tmp_path):
    """GPT-2's own files store 'h.0.attn...' rather than 'transformer.h.0.attn...'."""
    hf = make_tiny("gpt2", tmp_path / "hf")
    out = tmp_path / "bare"
    out.mkdir()
    (out / "config.json").write_text((tmp_path / "hf" / "config.json").read_text())
    tensors = {k.removeprefix("transformer."): v for k, v in load_file(tmp_path / "hf" / "model.safetensors").items()}
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    assert_parity(zoo.from_pretrained(out), reference(hf), exact_reference(hf))

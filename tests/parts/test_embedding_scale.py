"""The embedding scale: sqrt(d_model) or a number, rounded to a dtype (RecurrentGemma's bf16 50.5)."""

import math

import pytest
import torch

import zoo
from zoo.core.spec import SpecError


def tiny(**embedding):
    model = zoo.build("llama3-8b", n_layers=1, d_model=2560 // 40, vocab_size=32,
                      overrides={"embedding": embedding, "layers.*.mixer.n_heads": 2,
                                 "layers.*.mixer.n_kv_heads": 1, "layers.*.ffn.d_ff": 32})
    return model


def test_number_rounded_to_bfloat16_is_recurrent_gemmas_factor():
    # RecurrentGemma multiplies by sqrt(2560) = 50.596... rounded to bfloat16: 50.5.
    assert torch.tensor(math.sqrt(2560), dtype=torch.bfloat16).item() == 50.5
    model = tiny(scale=math.sqrt(2560), scale_dtype="bfloat16")
    ids = torch.arange(8)[None]
    raw = model.embed(ids)
    torch.testing.assert_close(model.embed_tokens(ids), raw * 50.5, rtol=0, atol=0)


def test_sqrt_d_model_in_float32_keeps_gemmas_rounding():
    model = tiny(scale="sqrt_d_model")
    ids = torch.arange(8)[None]
    raw = model.embed(ids)
    factor = torch.tensor(math.sqrt(64), dtype=torch.float32)
    torch.testing.assert_close(model.embed_tokens(ids), raw * factor, rtol=0, atol=0)
    # In bfloat16 the factor is the activation dtype's rounding (Gemma's normalizer).
    model = model.to(torch.bfloat16)
    got = model.embed_tokens(ids)
    torch.testing.assert_close(got, model.embed(ids) * torch.tensor(8.0, dtype=torch.bfloat16), rtol=0, atol=0)


def test_scale_dtype_differs_from_activation_rounding():
    d = 2560
    fp32 = torch.tensor(math.sqrt(d), dtype=torch.float32)
    bf16 = torch.tensor(math.sqrt(d), dtype=torch.bfloat16).float()
    assert fp32 != bf16  # so the option changes the result in float32 activations
    model = tiny(scale=math.sqrt(d), scale_dtype="bfloat16")
    ids = torch.arange(4)[None]
    assert not torch.equal(model.embed_tokens(ids), model.embed(ids) * fp32)


@pytest.mark.parametrize("embedding, field", [({"scale": -1.0}, "embedding.scale"),
                                               ({"scale": "sqrt"}, "embedding.scale"),
                                               ({"scale_dtype": "bfloat16"}, "embedding.scale_dtype"),
                                               ({"scale": 2.0, "scale_dtype": "int8"}, "embedding.scale_dtype")])
def test_bad_scale_names_the_field(embedding, field):
    with pytest.raises(SpecError, match=field.replace(".", r"\.")):
        tiny(**embedding)


def test_number_scale_round_trips_through_the_spec():
    spec = zoo.get_spec("llama3-8b", overrides={"embedding": {"scale": 50.5, "scale_dtype": "bfloat16"}})
    again = zoo.ModelSpec.from_dict(spec.to_dict())
    assert again.embedding == spec.embedding and again.embedding.scale == 50.5

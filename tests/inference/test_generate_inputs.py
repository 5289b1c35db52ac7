"""zoo.generate refuses bad inputs with a ValueError naming the argument, before any compute."""

import math

import pytest
import torch

import zoo


@pytest.fixture(scope="module")
def model():
    return zoo.build("llama3-8b", n_layers=1, d_model=32, vocab_size=64, max_seq_len=32,
                     **{"layers.*.mixer.n_heads": 4, "layers.*.mixer.n_kv_heads": 2, "layers.*.ffn.d_ff": 64})


@pytest.fixture
def no_compute(model, monkeypatch):
    def refuse(*a, **k):
        raise AssertionError("the model ran: the error came too late")

    monkeypatch.setattr(model, "hidden_states", refuse)
    monkeypatch.setattr(model, "new_state", refuse)


IDS = torch.tensor([[1, 2, 3, 4]])


@pytest.mark.parametrize("kwargs, message", [
    (dict(input_ids=torch.tensor([[1, 64, 3]])), r"input_ids holds token id 64, outside the model's vocabulary \[0, 64\)"),
    (dict(input_ids=torch.tensor([[1, -1, 3]])), r"input_ids holds token id -1, outside"),
    (dict(input_ids=torch.tensor([[1.0, 2.0]])), r"input_ids must hold integer token ids, got dtype torch.float32"),
    (dict(max_new_tokens=10**13), r"max_new_tokens 10000000000000 .* beyond zoo's limit on a context 16777216"),
    (dict(max_new_tokens=2.5), r"max_new_tokens must be an integer, got 2.5"),
    (dict(temperature=math.nan), r"temperature must be a finite number >= 0, got nan"),
    (dict(temperature=math.inf), r"temperature must be a finite number >= 0, got inf"),
    (dict(temperature=-1.0), r"temperature must be a finite number >= 0, got -1.0"),
    (dict(attention_mask=torch.tensor([[0, 2, 1, 1]])), r"attention_mask must hold only 0 \(padding\) and 1 .* \[2\]"),
    (dict(stop=[5, 64]), r"stop holds token id 64, outside the model's vocabulary \[0, 64\)"),
    (dict(stop=-3), r"stop holds token id -3, outside"),
    (dict(pad_token_id=-1, stop=5), r"pad_token_id must be >= 0, got -1"),
    (dict(top_k=0, temperature=1.0), r"top_k must be a positive integer, got 0"),
    (dict(top_p=math.nan, temperature=1.0), r"top_p must be in \(0, 1\], got nan"),
])
def test_bad_generation_inputs_are_refused_before_any_compute(model, no_compute, kwargs, message):
    args = {"input_ids": IDS, "max_new_tokens": 4, **kwargs}
    with pytest.raises(ValueError, match=message):
        zoo.generate(model, args.pop("input_ids"), args.pop("max_new_tokens"), **args)


def test_learned_positions_stop_at_max_seq_len_before_any_compute(monkeypatch):
    learned = zoo.build("gpt3-125m", n_layers=1, d_model=32, vocab_size=64, max_seq_len=32,
                        overrides={"layers.*.mixer.n_heads": 4})
    assert zoo.generate(learned, IDS, 28).shape == (1, 32)  # up to the table's last row
    monkeypatch.setattr(learned, "hidden_states", lambda *a, **k: pytest.fail("the model ran"))
    with pytest.raises(ValueError, match=r"max_new_tokens 29 after a prompt of 4 tokens reaches 33, beyond the "
                                         r"learned position encoding's limit \(max_seq_len\) 32; generate at most 28"):
        zoo.generate(learned, IDS, 29)


def test_rope_models_generate_past_max_seq_len(model):
    """RoPE has no table to run out of (transformers' dynamic NTK scaling is made for this)."""
    out = zoo.generate(model, IDS, 40, attention_mask=torch.ones_like(IDS, dtype=torch.bool))
    assert out.shape == (1, 44)

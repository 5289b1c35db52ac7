"""transformers' spellings where its users reach for them: ``generate``'s ``do_sample=`` and
``eos_token_id=`` (read at the edges by ``Generation.from_transformers``) and
``model(ids, return_dict=True).logits``, beside zoo's own (which keep working unchanged)."""

import pytest
import torch

import zoo
from zoo.inference.generate import Generation
from zoo.model import CausalLMOutput

TINY = {"n_layers": 2, "d_model": 64, "vocab_size": 128, "layers.*.ffn.d_ff": 96,
        "layers.*.mixer.n_heads": 4, "layers.*.mixer.n_kv_heads": 2}


@pytest.fixture(scope="module")
def model():
    return zoo.build("llama2-7b", overrides=TINY, seed=0).eval()


def test_do_sample_false_is_greedy_and_true_samples(model):
    ids = torch.randint(0, 128, (1, 5), generator=torch.Generator().manual_seed(0))
    greedy = zoo.generate(model, ids, 8)
    hf = Generation.from_transformers
    assert torch.equal(zoo.generate(model, ids, settings=hf(max_new_tokens=8, do_sample=False, temperature=0.7)),
                       greedy)
    # do_sample=True at transformers' default temperature 1.0 is zoo's temperature=1.0 draw
    sampled = zoo.generate(model, ids, settings=hf(max_new_tokens=8, do_sample=True, top_p=0.95, seed=1))
    assert torch.equal(sampled, zoo.generate(model, ids, 8, temperature=1.0, top_p=0.95, seed=1))
    assert not torch.equal(sampled, greedy)  # 8 draws from a near-flat distribution over 128 tokens
    with pytest.raises(ValueError, match="do_sample"):
        hf(max_new_tokens=2, do_sample="yes")


def test_eos_token_id_stops_as_stop_does(model):
    ids = torch.randint(0, 128, (2, 5), generator=torch.Generator().manual_seed(1))
    free = zoo.generate(model, ids, 8)
    eos = int(free[0, 7])
    expected = zoo.generate(model, ids, 8, stop=eos, pad_token_id=0)
    for given in (eos, [eos]):
        settings = Generation.from_transformers(max_new_tokens=8, eos_token_id=given, pad_token_id=0)
        assert settings.stop == (eos,) and torch.equal(zoo.generate(model, ids, settings=settings), expected)
    assert expected.shape[1] < free.shape[1] or (expected[0, 8:] == 0).all()


@torch.no_grad()
def test_return_dict_gives_logits_loss_and_hidden_states(model):
    ids = torch.randint(0, 128, (2, 9), generator=torch.Generator().manual_seed(2))
    bare = model(ids)
    assert isinstance(bare, torch.Tensor) and type(bare) is torch.Tensor  # today's callers are unchanged
    out = model(ids, return_dict=True)
    assert isinstance(out, CausalLMOutput) and out.loss is None and out.hidden_states is None
    assert torch.equal(out.logits, bare) and torch.equal(out["logits"], bare) and torch.equal(out[0], bare)
    out = model(ids, return_dict=True, output_hidden_states=True)
    final, layers = model.hidden_states(ids, output_hidden_states=True)
    assert len(out.hidden_states) == 3  # embeddings, layer 1, layer 2 after the final norm
    assert torch.equal(out.hidden_states[0], layers[0]) and torch.equal(out.hidden_states[-1], final)
    # labels as transformers takes them: unshifted, the loss predicts labels[:, 1:]
    out = model(ids, labels=ids, return_dict=True)
    expected = torch.nn.functional.cross_entropy(bare[:, :-1].reshape(-1, 128), ids[:, 1:].reshape(-1))
    torch.testing.assert_close(out.loss, expected)
    assert torch.equal(out.logits, bare) and torch.equal(out[0], out.loss)
    with pytest.raises(ValueError, match="return_dict"):
        model(ids, output_hidden_states=True)

"""Greedy generation equals transformers' greedy ``generate``, token for token, on tiny random
checkpoints written by transformers itself, for every checkpoint format zoo ships. Prompts are
longer than the formats' sliding windows, so prefill and decode both run past them."""

import pytest
import torch

import zoo

transformers = pytest.importorskip("transformers")
tiny = pytest.importorskip("zoo.checkpoints.tiny")

from hf_pairs import own_tiny_formats  # noqa: E402

FORMATS = own_tiny_formats()  # an installed plugin's formats are its own tests' business


def hf_greedy(model, ids, n, attention_mask=None):
    return model.generate(ids, attention_mask=attention_mask, max_new_tokens=n, min_new_tokens=n, do_sample=False,
                          num_beams=1, pad_token_id=0, eos_token_id=None)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    made = {}

    def get(model_type):
        if model_type not in made:
            d = tmp_path_factory.mktemp(model_type)
            made[model_type] = (tiny.make_tiny(model_type, d), zoo.from_pretrained(d))
        return made[model_type]

    return get


@pytest.mark.parametrize("model_type", FORMATS)
@torch.no_grad()
def test_greedy_equals_transformers(model_type, checkpoints):
    hf, ours = checkpoints(model_type)
    vocab = ours.spec.vocab_size
    ids = torch.randint(0, vocab, (1, 12), generator=torch.Generator().manual_seed(0))
    expected = hf_greedy(hf, ids, 16)
    assert torch.equal(zoo.generate(ours, ids, 16), expected)


@pytest.mark.parametrize("model_type", [m for m in ("mistral", "gemma2") if m in FORMATS])
@torch.no_grad()
def test_left_padded_batch_equals_transformers(model_type, checkpoints):
    hf, ours = checkpoints(model_type)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(1, ours.spec.vocab_size, (2, 12), generator=g)
    mask = torch.ones_like(ids)
    ids[1, :5], mask[1, :5] = 0, 0
    expected = hf_greedy(hf, ids, 12, attention_mask=mask)
    assert torch.equal(zoo.generate(ours, ids, 12, attention_mask=mask), expected)

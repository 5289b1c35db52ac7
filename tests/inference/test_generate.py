"""Generation and the KV cache on tiny zoo models: cached decoding must compute exactly what a full
forward over the whole sequence computes (the no-cache path is the reference), also past the
sliding window, with a ring buffer, GQA/MQA and left-padded batches."""

import pytest
import torch

import zoo
from zoo.core.state import DecodeState, KVState
from zoo.inference.generate import sample_next

TINY = {
    "n_layers": 2, "d_model": 64, "vocab_size": 128, "layers.*.ffn.d_ff": 96,
    "layers.*.mixer.n_heads": 4, "layers.*.mixer.n_kv_heads": 2, "layers.*.mixer.head_dim": 16,
}
# Windows much shorter than the prompt, so prefill and decode both run past them.
FAMILIES = {
    "llama2-7b": {},
    "mistral-7b": {"layers.*.mixer.window": 4},
    "gemma2-2b": {"layers.local.mixer.window": 5},
    "gemma3-1b": {"n_layers": 6, "layers.local.mixer.window": 3, "layers.*.mixer.n_kv_heads": 1},
    "olmo2-7b": {},
    "gpt3-125m": {"layers.*.mixer.n_kv_heads": 4},
    "transformer-2017": {"layers.*.mixer.n_kv_heads": 4},
}


def tiny(name, **extra):
    return zoo.build(name, overrides={**TINY, **extra}, seed=0).eval()


def greedy_without_cache(model, ids, n):
    for _ in range(n):
        ids = torch.cat([ids, model(ids)[:, -1].argmax(-1, keepdim=True)], dim=1)
    return ids


@pytest.mark.parametrize("name", FAMILIES)
@torch.no_grad()
def test_cached_decode_matches_full_forward(name):
    model = tiny(name, **FAMILIES[name])
    ids = torch.randint(0, 128, (1, 9))
    out = zoo.generate(model, ids, 12)
    assert torch.equal(out, greedy_without_cache(model, ids, 12))
    # Logits of prefill + one-token steps equal the full forward's, position by position.
    state = model.new_state(1)
    steps = [model(out[:, :9], state=state)] + [model(out[:, i : i + 1], state=state) for i in range(9, out.shape[1])]
    torch.testing.assert_close(torch.cat(steps, 1), model(out), atol=1e-5, rtol=1e-5)


@torch.no_grad()
def test_ring_buffer_is_bounded_and_equals_a_full_cache():
    model = tiny("mistral-7b", **{"layers.*.mixer.window": 4})
    ids = torch.randint(0, 128, (2, 6))
    # A full cache: the mask alone applies the window.
    ring, full = model.new_state(2), DecodeState([KVState(window=None) for _ in range(2)])
    a, b = model(ids, state=ring), model(ids, state=full)
    sizes = []
    for t in range(20):
        nxt = a[:, -1:].argmax(-1)
        a, b = model(nxt, state=ring), model(nxt, state=full)
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
        sizes.append(ring.nbytes())
    assert len(set(sizes)) == 1  # bounded: the ring never grows
    # window 4, 2 kv heads, head_dim 16, fp32: 2 (k, v) * 2 layers * batch 2 * 2 heads * 4 slots * 16 * 4 bytes
    assert sizes[0] == 2 * 2 * 2 * 2 * 4 * 16 * 4
    assert full.nbytes() > 6 * sizes[0]


@torch.no_grad()
def test_cache_is_sized_by_kv_heads():
    nbytes = {}
    for kv in (4, 2, 1):  # MHA, GQA, MQA
        model = tiny("llama2-7b", **{"layers.*.mixer.n_kv_heads": kv})
        cache = model.new_state(1)
        model(torch.randint(0, 128, (1, 10)), state=cache)
        nbytes[kv] = cache.nbytes()
    assert nbytes[4] == 2 * 2 * 4 * 10 * 16 * 4  # k and v, 2 layers, 4 heads, 10 slots, head_dim 16, fp32
    assert nbytes[4] == 2 * nbytes[2] == 4 * nbytes[1]


@pytest.mark.parametrize("name", ["gemma2-2b", "llama2-7b"])
@torch.no_grad()
def test_left_padded_batch_matches_each_prompt_alone(name):
    model = tiny(name, **FAMILIES[name])
    a, b = torch.randint(1, 128, (7,)), torch.randint(1, 128, (3,))
    ids = torch.zeros(2, 7, dtype=torch.long)
    mask = torch.zeros(2, 7, dtype=torch.long)
    ids[0], mask[0] = a, 1
    ids[1, 4:], mask[1, 4:] = b, 1
    out = zoo.generate(model, ids, 10, attention_mask=mask)
    assert torch.equal(out[0, 7:], zoo.generate(model, a[None], 10)[0, 7:])
    assert torch.equal(out[1, 7:], zoo.generate(model, b[None], 10)[0, 3:])


@torch.no_grad()
def test_stop_token_ends_generation_and_pads_finished_rows():
    model = tiny("llama2-7b")
    ids = torch.randint(0, 128, (2, 5))
    free = zoo.generate(model, ids, 8)
    stop = int(free[0, 7])  # row 0's third new token
    out = zoo.generate(model, ids, 8, stop=stop, pad_token_id=0)
    ends = []
    for row in range(2):
        hits = (free[row, 5:] == stop).nonzero()
        end = 5 + 8 if len(hits) == 0 else 6 + int(hits[0, 0])  # up to and including the stop token
        ends.append(end)
        assert torch.equal(out[row, :end], free[row, :end])
        assert (out[row, end:] == 0).all()
    assert out.shape[1] == max(ends)  # generation ends once every row has stopped


@torch.no_grad()
def test_sampling_is_seeded_and_streams():
    model = tiny("llama2-7b")
    ids = torch.randint(0, 128, (1, 4))
    seen = []
    a = zoo.generate(model, ids, 6, temperature=1.0, top_p=0.9, seed=3, callback=seen.append)
    b = zoo.generate(model, ids, 6, temperature=1.0, top_p=0.9, seed=3)
    c = zoo.generate(model, ids, 6, temperature=1.0, top_p=0.9, seed=4)
    assert torch.equal(a, b) and not torch.equal(a, c)
    assert torch.equal(torch.stack(seen, 1), a[:, 4:])
    # top_k=1 leaves only the argmax, whatever the temperature.
    assert torch.equal(zoo.generate(model, ids, 6, temperature=5.0, top_k=1, seed=0), zoo.generate(model, ids, 6))


def test_top_p_keeps_the_smallest_nucleus():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    draws = {int(sample_next(logits, temperature=1.0, top_p=0.8, generator=torch.Generator().manual_seed(s))) for s in range(200)}
    assert draws == {0, 1}
    draws = {int(sample_next(logits, temperature=1.0, top_k=3, generator=torch.Generator().manual_seed(s))) for s in range(300)}
    assert draws == {0, 1, 2}


def test_bad_arguments_are_named():
    model = tiny("llama2-7b")
    with pytest.raises(ValueError, match="left-padded"):
        zoo.generate(model, torch.ones(2, 3, dtype=torch.long), 2, attention_mask=torch.tensor([[1, 1, 0], [1, 1, 1]]))
    with pytest.raises(ValueError, match="top_p"):
        zoo.generate(model, torch.ones(1, 3, dtype=torch.long), 2, temperature=1.0, top_p=1.5)

"""Packed documents: the logits of a sequence of several documents equal each document run alone
(positions restart, attention stays inside, recurrent state and convolutions reset), on every path."""

import pytest
import torch

import zoo.testing as zt

MLA = {"name": "mla", "n_heads": 4, "kv_lora_rank": 16, "qk_nope_head_dim": 8, "qk_rope_head_dim": 4,
       "v_head_dim": 12}
MAMBA2 = {"n_heads": 4, "head_dim": 8, "state_size": 8, "n_groups": 2, "chunk_size": 4, "bias": True,
          "dt_limit_min": 0.01, "dt_limit_max": 0.5}
GDN = {"n_heads": 4, "n_key_heads": 2, "key_dim": 8, "value_dim": 6, "chunk_size": 4}

SPECS = {
    "attention": lambda: zt.tiny_spec(),
    "sliding window": lambda: zt.tiny_spec({"layers.default.mixer.window": 3}),
    "mla": lambda: zt.tiny_spec({"layers.default.mixer": MLA}),
    "mamba2": lambda: zt.hybrid_spec("mamba2", MAMBA2),
    "gated deltanet": lambda: zt.hybrid_spec("gated_deltanet", GDN),
}
LENGTHS = (5, 1, 7, 3)
# float64 weights and activations; RoPE's angles are float32 tables, so a document at offset 0 and the
# same document alone agree to float32 rounding of the angles (about 1e-6 relative), not float64's.
TOL = dict(rtol=1e-5, atol=1e-6)  # a document of one token, chunks (4) cut inside documents, a window (3) shorter than them


def _packed(lengths, seed=0):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 64, (1, sum(lengths)), generator=gen)
    docs = torch.cat([torch.full((n,), i) for i, n in enumerate(lengths)])[None]
    return ids, docs


def _each_alone(model, ids, lengths):
    out, start = [], 0
    for n in lengths:
        out.append(model(ids[:, start:start + n]))
        start += n
    return torch.cat(out, 1)


@pytest.mark.parametrize("backend", ["eager", "sdpa", "flex"])
@pytest.mark.parametrize("name", list(SPECS))
@torch.no_grad()  # FlexAttention has no backward on the CPU
def test_a_packed_sequence_equals_each_document_alone(name, backend):
    model = zt.tiny_model(SPECS[name](), dtype=torch.float64)
    attention = [l.mixer for l in model.layers if hasattr(l.mixer, "backend")]
    if backend != "eager" and not attention:
        pytest.skip("no attention backend to choose")
    if name == "mla" and backend != "eager":
        pytest.skip("MLA has one attention path")
    for mixer in attention:
        mixer.backend = backend
    ids, docs = _packed(LENGTHS)
    alone = _each_alone(model, ids, LENGTHS)
    packed = model(ids, document_ids=docs)
    torch.testing.assert_close(packed, alone, **TOL)
    # and without the documents the seams leak: the test can tell the two apart
    assert not torch.allclose(model(ids), alone, rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize("window", [None, 100])
@torch.no_grad()
def test_flex_block_masks_skip_and_fill_whole_blocks_by_document(window):
    """Documents longer than FlexAttention's 128-token blocks: blocks of one document are full, blocks
    of documents that cannot meet are skipped, the rest masked; the same logits as each alone."""
    from zoo.components.kernels.attention import block_mask

    lengths = (130, 200, 60, 1, 121)
    spec = zt.tiny_spec({"max_seq_len": 1024, **({"layers.default.mixer.window": window} if window else {})})
    model = zt.tiny_model(spec, dtype=torch.float64)
    for layer in model.layers:
        layer.mixer.backend = "flex"
    ids, docs = _packed(lengths)
    torch.testing.assert_close(model(ids, document_ids=docs), _each_alone(model, ids, lengths), **TOL)
    slots = torch.arange(ids.shape[1])
    mask = block_mask(slots, slots, window, None, docs)
    dense = mask.to_dense()[0, 0]  # (query blocks, key blocks): 1 where computed
    assert dense[3, 0] == 0  # tokens 384..511 (the third document and later) never meet the first's keys
    assert dense[1, 1] == 1 and dense[0, 0] == 1


def test_two_rows_of_different_packings_and_the_loss():
    """Rows pack differently; the loss with labels -100 at each document's first token is the mean over
    the documents' own next-token losses."""
    model = zt.tiny_model(zt.hybrid_spec("gated_deltanet", GDN), dtype=torch.float64)
    a, da = _packed((6, 10), seed=1)
    b, db = _packed((3, 4, 9), seed=2)
    ids, docs = torch.cat([a, b]), torch.cat([da, db])
    packed = model(ids, document_ids=docs)
    torch.testing.assert_close(packed[0:1], _each_alone(model, a, (6, 10)), **TOL)
    torch.testing.assert_close(packed[1:2], _each_alone(model, b, (3, 4, 9)), **TOL)
    labels = ids.clone()
    labels[:, 1:][docs[:, 1:] != docs[:, :-1]] = -100
    loss = model(ids, labels=labels, document_ids=docs).loss
    logp = torch.log_softmax(packed[:, :-1], -1).gather(-1, ids[:, 1:, None])[..., 0]
    keep = labels[:, 1:] != -100
    torch.testing.assert_close(loss, -(logp[keep]).mean(), **TOL)


def test_a_mixer_that_cannot_keep_documents_apart_is_refused_by_name():
    spec = zt.tiny_spec({"layers.default.mixer": {"name": "linear_attention", "n_heads": 4}})
    model = zt.tiny_model(spec)
    ids, docs = _packed((4, 4))
    with pytest.raises(ValueError, match="layer 0's mixer 'linear_attention'.*packing = 'plain'"):
        model(ids, document_ids=docs)

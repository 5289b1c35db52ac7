"""The loader on prepared shards: the order is a pure function of the seed and the samples consumed,
ranks read disjoint samples covering each epoch once (for any number of processes), mixtures keep
their weights, and supervised data masks exactly the assistant's tokens."""

import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from zoo.training.loader import ROUND, Mixture, Source, open_sources, permute
from zoo.training.shards import DataError, Prepared, prepare

sys.path.insert(0, str(Path(__file__).parents[1] / "formats"))


def _corpus(tmp_path, name="a", n=50, seed=0):
    rows = [{"text": f"{name} document {i}: " + "word " * ((i * 7 + seed) % 13)} for i in range(n)]
    (tmp_path / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    prepare([tmp_path / f"{name}.jsonl"], tmp_path / name, None, workers=1, shard_tokens=300, progress=False)
    return tmp_path / name


def test_the_permutation_is_a_bijection_for_any_size():
    for n in (1, 2, 3, 17, 1000, 4097):
        p = permute(np.arange(n), n, 12345)
        assert sorted(p.tolist()) == list(range(n))
    assert permute(np.arange(100), 100, 1).tolist() != permute(np.arange(100), 100, 2).tolist()


def test_batches_are_a_pure_function_of_seed_and_position_and_ranks_cover_each_epoch_once(tmp_path):
    path = _corpus(tmp_path)
    stream = open_sources([{"path": path}], None, 16, packing="documents", sft=False, seed=3)
    n = stream.n_samples
    whole = stream.batch(0, 2 * n)
    again = open_sources([{"path": path}], None, 16, packing="documents", sft=False, seed=3)
    for start in (0, 5, n - 3, n + 1):  # any resume point, in either epoch
        part = again.batch(start, 7)
        assert torch.equal(part.ids, whole.ids[start:start + 7]) and torch.equal(part.labels, whole.labels[start:start + 7])
        assert torch.equal(part.documents, whole.documents[start:start + 7])
    rows = {tuple(r) for r in whole.ids[:n].tolist()}
    corpus = Prepared(path)
    windows = {tuple(corpus.span(i * 16, (i + 1) * 16)[0].tolist()) for i in range(n)}
    assert rows == windows  # each window once in the first epoch
    # The loop's reading, per_rank = micro_batch x accumulation, global batch 8: 2 then 4 processes.
    for processes in (1, 2, 4):
        per_rank, seen = 8 // processes, []
        for position in range(0, n - n % 8, 8):
            for rank in range(processes):
                seen += again.batch(position + rank * per_rank, per_rank).ids.tolist()
        assert seen == whole.ids[:n - n % 8].tolist()  # disjoint, and the same stream whatever the layout
    other = open_sources([{"path": path}], None, 16, packing="documents", sft=False, seed=4).batch(0, n)
    assert not torch.equal(other.ids, whole.ids[:n])


def test_documents_restart_and_a_documents_first_token_is_no_target(tmp_path):
    path = _corpus(tmp_path)
    src = Source(Prepared(path), 32, packing="documents")
    corpus = Prepared(path)
    j = next(j for j in range(src.n) if len(set(corpus.span(j * 32, (j + 1) * 32)[1].tolist())) > 2)
    ids, labels, docs = src.sample(j)
    tokens, numbers, _ = corpus.span(j * 32, (j + 1) * 32)
    assert ids.tolist() == tokens.tolist() and docs.tolist() == (numbers - numbers[0]).tolist()
    starts = np.flatnonzero(np.diff(docs)) + 1
    assert len(starts) and (labels[starts] == -100).all()
    assert (np.delete(labels, starts) == np.delete(ids, starts)).all()
    plain = Source(Prepared(path), 32, packing="plain").sample(j)
    assert plain[2] is None and (plain[1] == ids).all()


def test_a_mixture_gives_each_source_its_weight_of_every_round(tmp_path):
    a, b = _corpus(tmp_path, "a"), _corpus(tmp_path, "b", seed=5)
    mix = open_sources([{"path": a, "weight": 3}, {"path": b, "weight": 1}], None, 16, packing="plain", sft=False,
                       seed=0)
    src, j = mix.locate(np.arange(2 * ROUND))
    assert (src[:ROUND] == 0).sum() == 750 and (src[ROUND:] == 0).sum() == 750
    for s in (0, 1):  # each source's own stream, each of its samples once: 0, 1, 2, ... in some order
        assert sorted(j[src == s].tolist()) == list(range((src == s).sum()))


def test_a_held_out_fraction_is_never_trained_on(tmp_path):
    path = _corpus(tmp_path)
    train = open_sources([{"path": path}], None, 16, packing="plain", sft=False, seed=0, val_fraction=0.2)
    val = open_sources([{"path": path}], None, 16, packing="plain", sft=False, seed=0, val_fraction=0.2, split="val")
    corpus = Prepared(path)
    total = corpus.n_tokens // 16
    windows = [corpus.span(i * 16, (i + 1) * 16)[0].tolist() for i in range(total)]
    n = train.n_samples
    assert n + val.n_samples == total and val.n_samples == 28
    assert val.batch(0, val.n_samples).ids.tolist() == windows[n:]  # the last windows, in order
    assert sorted(train.batch(0, n).ids.tolist()) == sorted(windows[:n])  # an epoch: the others, each once


CHATS = [
    {"messages": [{"role": "user", "content": "Hi there"}, {"role": "assistant", "content": "Hello! How can I help?"}]},
    {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"},
                  {"role": "assistant", "content": "4"}, {"role": "user", "content": "and 3+3?"},
                  {"role": "assistant", "content": "6"}]},
    {"prompt": "The capital of France is", "completion": " Paris."},
]


def test_sft_masks_exactly_the_assistant_tokens_of_the_models_own_template(tmp_path):
    from test_gguf_smollm2 import smollm2_file

    from zoo.inference.conversation import render
    from zoo.inference.tokenizer import Tokenizer

    tok = Tokenizer(smollm2_file())
    (tmp_path / "chat.jsonl").write_text("".join(json.dumps(r) + "\n" for r in CHATS))
    prepare([tmp_path / "chat.jsonl"], tmp_path / "out", tok, workers=1, progress=False)
    corpus = Prepared(tmp_path / "out", tok)
    end = "<|im_end|>\n"  # the end of SmolLM2's assistant turn, which the template writes after the content
    for d, row in enumerate(CHATS):
        ids, mask = corpus.document(d), corpus.document_mask(d)
        if "messages" in row:  # the tokens are the template's rendering, encoded as zoo chat encodes it
            text = render(tok.chat_template, row["messages"], add_generation_prompt=False, bos_token="")
            assert ids.tolist() == tok.encode(text, add_special_tokens=False)
            want = [tok.encode(m["content"] + end, add_special_tokens=False)
                    for m in row["messages"] if m["role"] == "assistant"]
        else:
            assert ids.tolist() == tok.encode(row["prompt"]) + tok.encode(row["completion"], add_special_tokens=False) \
                + tok.eos_token_ids[:1]
            want = [tok.encode(row["completion"], add_special_tokens=False) + tok.eos_token_ids[:1]]
        runs = np.split(ids[mask == 1], np.flatnonzero(np.diff(np.flatnonzero(mask == 1)) > 1) + 1)
        assert [r.tolist() for r in runs] == want
    src = Source(corpus, 256, sft=True)
    ids, labels, docs = src.sample(0)  # every conversation in one sequence, the rest padding
    assert len(src.groups) == 2 and docs.max() == 3
    kept = labels != -100
    assert ids[kept].tolist() == [t for d in range(3) for t in corpus.document(d)[corpus.document_mask(d) == 1]]
    with pytest.raises(DataError, match=r"chat.jsonl:1: a record of \d+ tokens, longer than seq_len 40"):
        Source(corpus, 40, sft=True)
    with pytest.raises(DataError, match="sft needs chat"):
        Source(Prepared(_corpus(tmp_path)), 40, sft=True)

"""Prepared data: ``zoo data prepare`` writes shards that equal the tokenizer's own output document by
document, reload bit-identically and resume exactly; hostile sources are refused naming the file and line."""

import json
import sys
from pathlib import Path

import numpy as np
import pytest

from zoo.training.data import ByteTokenizer
from zoo.training.shards import DataError, Prepared, prepare

sys.path.insert(0, str(Path(__file__).parents[1] / "formats"))

TEXTS = ["The first document.\n", "A second one, a little longer than the first.", "x", "Ünïcödé is fine: ☃",
         "a last document " * 20]


def _jsonl(path: Path, rows) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _docs(corpus: Prepared):
    return [corpus.document(d).tolist() for d in range(corpus.n_docs)]


def _bytes(texts):
    return [list(t.encode()) for t in texts]


def test_every_source_kind_gives_the_tokenizers_own_tokens_document_by_document(tmp_path):
    import datasets

    _jsonl(tmp_path / "a.jsonl", [{"text": t} for t in TEXTS[:2]])
    (tmp_path / "b.txt").write_text(TEXTS[2])
    rows = {"text": TEXTS[3:]}
    datasets.Dataset.from_dict(rows).to_parquet(str(tmp_path / "c.parquet"))
    datasets.Dataset.from_dict(rows).save_to_disk(str(tmp_path / "d"))
    arrow = next((tmp_path / "d").glob("*.arrow"))
    sources = [tmp_path / "a.jsonl", tmp_path / "b.txt", tmp_path / "c.parquet", tmp_path / "d", arrow]
    m = prepare(sources, tmp_path / "out", None, workers=1, progress=False)
    corpus = Prepared(tmp_path / "out", ByteTokenizer())
    want = _bytes(TEXTS[:3] + TEXTS[3:] + TEXTS[3:] + TEXTS[3:])
    assert _docs(corpus) == want  # bytes: no BOS, no EOS
    assert m["documents"] == len(want) and m["tokens"] == sum(map(len, want)) and m["dtype"] == "uint16"
    assert [corpus.origin(d) for d in (0, 1, 2, 3)] == [f"{tmp_path}/a.jsonl:1", f"{tmp_path}/a.jsonl:2",
                                                          f"{tmp_path}/b.txt:1", f"{tmp_path}/c.parquet:1"]


def test_a_real_tokenizer_in_two_processes_adds_its_bos_rule_and_eos_between_documents(tmp_path):
    from test_gguf_smollm2 import smollm2_file

    from zoo.inference.tokenizer import Tokenizer

    tok = Tokenizer(smollm2_file())
    _jsonl(tmp_path / "a.jsonl", [{"text": t} for t in TEXTS])
    m = prepare([tmp_path / "a.jsonl"], tmp_path / "out", tok, workers=2, progress=False, batch_docs=2)
    eos = tok.eos_token_ids[0]
    assert _docs(Prepared(tmp_path / "out", tok)) == [tok.encode(t) + [eos] for t in TEXTS]
    assert m["tokenizer"]["vocab_size"] == tok.vocab_size and m["tokenizer"]["eos"] == eos
    with pytest.raises(DataError, match="prepared with another tokenizer"):
        Prepared(tmp_path / "out", ByteTokenizer())


def test_a_prepared_corpus_reloads_bit_identically_and_a_resumed_prepare_equals_an_uninterrupted_one(tmp_path):
    rows = [{"text": f"document {i} " * (1 + i % 7)} for i in range(60)]
    _jsonl(tmp_path / "a.jsonl", rows)
    whole = prepare([tmp_path / "a.jsonl"], tmp_path / "whole", None, workers=1, shard_tokens=200, progress=False)
    assert len(whole["shards"]) > 3
    cut = prepare([tmp_path / "a.jsonl"], tmp_path / "cut", None, workers=1, shard_tokens=200, progress=False,
                  stop_after_shards=2)
    assert cut.get("interrupted") and not (tmp_path / "cut" / "manifest.json").exists()
    with pytest.raises(DataError, match="interrupted prepare"):
        Prepared(tmp_path / "cut")
    (tmp_path / "cut" / "shard-00002.bin").write_bytes(b"half a shard")  # written after the last record
    resumed = prepare([tmp_path / "a.jsonl"], tmp_path / "cut", None, workers=1, shard_tokens=200, progress=False)
    assert resumed == whole | {"shards": resumed["shards"]} and resumed["shards"] == whole["shards"]
    for sh in whole["shards"]:
        for f in (sh["bin"], sh["idx"]):
            assert (tmp_path / "whole" / f).read_bytes() == (tmp_path / "cut" / f).read_bytes()
    a, b = Prepared(tmp_path / "whole"), Prepared(tmp_path / "cut")
    assert a.n_docs == 60 and _docs(a) == _docs(b) == _bytes([r["text"] for r in rows])
    assert prepare([tmp_path / "a.jsonl"], tmp_path / "whole", None, workers=1, shard_tokens=200,
                   progress=False) == whole  # already prepared: nothing redone


def test_hostile_sources_are_refused_naming_the_file_and_line_and_leave_no_manifest(tmp_path):
    (tmp_path / "empty.txt").write_text("")
    (tmp_path / "binary.txt").write_bytes(b"\x7fELF\x00\x01\x02")
    (tmp_path / "latin1.txt").write_bytes(b"ok\nnot utf-8: \xff\n")
    (tmp_path / "bad.jsonl").write_text('{"text": "fine"}\n{"text": "fine"}\n{not json\n')
    _jsonl(tmp_path / "nofield.jsonl", [{"text": "fine"}, {"body": "where is the text?"}])
    _jsonl(tmp_path / "badchat.jsonl", [{"messages": [{"role": "user"}]}])
    cases = {"empty.txt": r"empty.txt: the file is empty", "binary.txt": r"binary.txt: a binary file",
             "latin1.txt": r"latin1.txt:2: not UTF-8", "bad.jsonl": r"bad.jsonl:3: not a JSON object",
             "nofield.jsonl": r"nofield.jsonl:2: no 'text' field \(the record has \['body'\]\)",
             "badchat.jsonl": r"badchat.jsonl:1: 'messages' must be"}
    for name, match in cases.items():
        out = tmp_path / f"out-{name}"
        with pytest.raises(DataError, match=match):
            prepare([tmp_path / name], out, None, workers=1, progress=False)
        assert not (out / "manifest.json").exists()


def test_a_truncated_shard_and_a_foreign_manifest_are_refused_by_name(tmp_path):
    _jsonl(tmp_path / "a.jsonl", [{"text": "some text " * 30}] * 4)
    prepare([tmp_path / "a.jsonl"], tmp_path / "out", None, workers=1, progress=False)
    shard = tmp_path / "out" / "shard-00000.bin"
    shard.write_bytes(shard.read_bytes()[:-10])
    with pytest.raises(DataError, match=r"shard-00000.bin: \d+ bytes, but the manifest states .*truncated"):
        Prepared(tmp_path / "out")
    manifest = json.loads((tmp_path / "out" / "manifest.json").read_text())
    manifest["tokenizer"]["fingerprint"] = "0123456789abcdef"
    (tmp_path / "out" / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(DataError, match="another tokenizer"):
        prepare([tmp_path / "a.jsonl"], tmp_path / "out", None, workers=1, progress=False)

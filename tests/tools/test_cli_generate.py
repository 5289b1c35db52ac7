"""``zoo generate``: a checkpoint's tokenizer.json in, streamed text out, the same tokens as zoo.generate."""

import pytest
import torch
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers

import zoo
from zoo.cli import main
from zoo.inference.tokenizer import TextStream, Tokenizer

tiny = pytest.importorskip("zoo.checkpoints.tiny")
pytest.importorskip("transformers")


def byte_tokenizer():
    """A byte-level tokenizer with no merges: 256 tokens, any text round-trips, and multi-byte
    characters span several tokens (what streaming must not print half of)."""
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tok = HFTokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    return tok


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    d = tmp_path_factory.mktemp("gen")
    tiny.make_tiny("llama", d, overrides={"vocab_size": 256})
    byte_tokenizer().save(str(d / "tokenizer.json"))
    return d


def test_text_stream_never_prints_half_a_character(checkpoint):
    tok = Tokenizer(checkpoint)
    text = "héllo ✓ wörld"
    ids = tok.encode(text)
    assert len(ids) == len(text.encode("utf-8"))  # one token per byte
    stream = TextStream(tok)
    pieces = [stream.push(i) for i in ids]
    assert "".join(pieces) == text
    assert not any("\ufffd" in p for p in pieces)


def test_generate_command_streams_what_zoo_generates(checkpoint, capsys):
    assert main(["generate", str(checkpoint), "--prompt", "Hello", "-n", "12", "--no-stop"]) == 0
    printed = capsys.readouterr().out
    tok = Tokenizer(checkpoint)
    model = zoo.from_pretrained(checkpoint)
    ids = torch.tensor([tok.encode("Hello")])
    new = zoo.generate(model, ids, 12)[0, ids.shape[1]:]
    assert printed == "Hello" + tok.decode(new.tolist()).rstrip("\ufffd") + "\n"


def test_missing_tokenizer_is_named(tmp_path, capsys):
    assert main(["generate", str(tmp_path), "--prompt", "x"]) == 2
    assert "tokenizer.json" in capsys.readouterr().err

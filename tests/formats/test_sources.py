"""The one door for checkpoint files: open_source says what a path names, and every reader takes
what it found."""

import pytest
import torch

import zoo
from zoo.checkpoints import CheckpointError, config_to_spec, open_source
from zoo.checkpoints.files.native import save_native
from zoo.checkpoints.sources import Source, find, spec_of
from zoo.inference.tokenizer import Tokenizer

TINY = {"model_type": "llama", "vocab_size": 64, "hidden_size": 32, "intermediate_size": 48,
        "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8,
        "max_position_embeddings": 64, "rms_norm_eps": 1e-5, "tie_word_embeddings": False,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}}


@pytest.fixture(scope="module")
def model():
    return zoo.build_model(config_to_spec(TINY), seed=0)


def same_logits(a, b):
    ids = torch.arange(10)[None] % 64
    torch.testing.assert_close(a(ids), b(ids), rtol=1e-5, atol=1e-5)


def test_an_hf_directory_and_a_run_holding_it(tmp_path, model):
    zoo.save_pretrained(model, tmp_path / "run" / "final", model_type="llama")
    hf = open_source(tmp_path / "run" / "final")
    assert (hf.kind, hf.path, hf.run) == ("hf", tmp_path / "run" / "final", None)
    assert hf.config()["hidden_size"] == 32 and hf.spec() == model.spec
    run = open_source(tmp_path / "run")
    assert (run.kind, run.path, run.run) == ("hf", tmp_path / "run" / "final", tmp_path / "run")
    assert not run.holds_tokenizer()
    same_logits(zoo.from_pretrained(run, progress=False), model)
    assert open_source(run) is run


def test_zoo_own_layout(tmp_path, model):
    save_native(model, tmp_path / "own")
    found = open_source(tmp_path / "own")
    assert (found.kind, found.config()) == ("native", None)
    assert found.spec() == model.spec
    same_logits(zoo.from_pretrained(found), model)


def test_a_gguf_file_or_a_directory_holding_one(tmp_path, model):
    pytest.importorskip("gguf")
    path = zoo.save_gguf(model, tmp_path / "tiny.gguf", dtype="f32", model_type="llama")
    for given in (path, tmp_path):  # the file, or a directory holding one
        found = open_source(given)
        assert (found.kind, found.path) == ("gguf", path)
    assert found.config()["hidden_size"] == 32  # its metadata, read as an HF config
    assert found.spec().d_model == 32
    same_logits(zoo.from_pretrained(found, progress=False), model)


def test_what_is_no_checkpoint_and_a_run_without_its_export(tmp_path):
    (tmp_path / "empty").mkdir()
    assert find(tmp_path / "empty") is None and spec_of(tmp_path / "empty") is None
    assert spec_of("llama3-8b") is None  # a preset name
    (tmp_path / "run" / "checkpoints").mkdir(parents=True)
    with pytest.raises(CheckpointError, match="without its final/ export yet"):
        open_source(tmp_path / "run")
    with pytest.raises(FileNotFoundError, match="without its final/ export yet"):
        zoo.get_spec(tmp_path / "run")


def test_the_tokenizer_of_a_source(tmp_path, model):
    tokenizers = pytest.importorskip("tokenizers")
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel({"a": 0, "b": 1, "[UNK]": 2}, unk_token="[UNK]"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    zoo.save_pretrained(model, tmp_path / "run" / "final", model_type="llama")
    tok.save(str(tmp_path / "run" / "final" / "tokenizer.json"))
    source = open_source(tmp_path / "run")
    assert isinstance(source, Source) and source.holds_tokenizer()
    assert Tokenizer(source).encode("a b") == Tokenizer(tmp_path / "run").encode("a b") == [0, 1]

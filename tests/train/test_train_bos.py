"""zoo train begins every sequence as the tokenizer begins a text: BOS first where its own rule says
so (tokenizer.json's post-processor, tokenizer_config.json's add_bos_token), nothing for bytes."""

import importlib
import json

import pytest
import torch
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import models, pre_tokenizers, processors

from zoo.inference.tokenizer import Tokenizer
from zoo.training.data import ByteTokenizer, TokenData, bos_id

T = importlib.import_module("zoo.training.loop")
TINY = {"n_layers": 1, "d_model": 32, "vocab_size": 300, "max_seq_len": 64, "layers.*.mixer.n_heads": 4,
        "layers.*.mixer.n_kv_heads": 2, "layers.*.ffn.d_ff": 64}
BOS = 257


def save_tokenizer(directory, *, post_processor: bool, add_bos_token=None):
    """A byte-level tokenizer with <eos> (256) and <bos> (257); BOS in its post-processor, or not."""
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tok = HFTokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.add_special_tokens(["<eos>", "<bos>"])
    if post_processor:
        tok.post_processor = processors.TemplateProcessing(single="<bos> $A", special_tokens=[("<bos>", BOS)])
    directory.mkdir(exist_ok=True)
    tok.save(str(directory / "tokenizer.json"))
    config = {"bos_token": "<bos>", "eos_token": "<eos>"}
    if add_bos_token is not None:
        config["add_bos_token"] = add_bos_token
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    return directory


def test_the_tokenizers_own_rule_names_the_bos(tmp_path):
    assert Tokenizer(save_tokenizer(tmp_path / "post", post_processor=True)).bos_id == BOS
    assert Tokenizer(save_tokenizer(tmp_path / "config", post_processor=False, add_bos_token=True)).bos_id == BOS
    assert Tokenizer(save_tokenizer(tmp_path / "none", post_processor=False, add_bos_token=False)).bos_id is None
    assert bos_id(ByteTokenizer()) is None


def test_each_sequence_starts_with_bos_and_the_stream_follows():
    tokens = torch.arange(1000) % 200
    data = TokenData(tokens, seq_len=10, seed=3, bos=BOS)
    assert data.n_seqs == 1000 // 9
    whole = data.batch(0, data.n_seqs)
    assert (whole[:, 0] == BOS).all()
    rows = sorted(whole[:, 1:].tolist())
    assert rows == sorted(tokens[: data.n_seqs * 9].view(-1, 9).tolist())  # every text token once per epoch
    with pytest.raises(ValueError, match="seq_len"):
        TokenData(tokens, seq_len=1, bos=BOS)


@pytest.mark.parametrize("post_processor", [True, False])
def test_zoo_train_reads_sequences_that_start_with_bos(tmp_path, monkeypatch, post_processor):
    tok = save_tokenizer(tmp_path / "tok", post_processor=post_processor, add_bos_token=not post_processor)
    (tmp_path / "a.txt").write_text("the cat sat on the mat. " * 100)
    seen = []

    class Recording(TokenData):
        def batch(self, start, count):
            out = super().batch(start, count)
            seen.append(out)
            return out

    import zoo.training.data

    monkeypatch.setattr(zoo.training.data, "TokenData", Recording)  # the loop's text files are read there
    T.train("llama3-8b", overrides=TINY, steps=1, seq_len=16, global_batch=2, micro_batch=2, warmup_steps=0,
            data=(str(tmp_path / "a.txt"),), tokenizer=str(tok), out_dir=str(tmp_path / "run"), progress=False,
            plot=False, export=False, cpu=True)
    assert seen and all((b[:, 0] == BOS).all() and not (b[:, 1:] == BOS).any() for b in seen)

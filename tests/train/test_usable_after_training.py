"""What zoo train writes is usable afterwards: a run directory loads, describes and generates; a model
no HF format describes is exported in zoo's own layout; save_pretrained and --init-from exports carry
the tokenizer, its chat template and the token ids; zoo generate takes --tokenizer."""

import importlib
import json

import pytest
import torch
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers

import zoo
from zoo.cli import main
from zoo.inference.tokenizer import Tokenizer
from zoo.training.data import ByteTokenizer

T = importlib.import_module("zoo.training.loop")
tiny = pytest.importorskip("zoo.checkpoints.tiny")
pytest.importorskip("transformers")
pytestmark = pytest.mark.usefixtures("one_thread")

RUN = dict(steps=2, seq_len=16, global_batch=2, micro_batch=2, warmup_steps=0, progress=False, plot=False, cpu=True)
TEMPLATE = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"


def test_byte_tokenizer_json_is_the_bytes():
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        tok = Tokenizer(ByteTokenizer().save(d))
        text = "héllo ✓\n\tx"
        assert tok.encode(text) == list(text.encode("utf-8")) and tok.decode(tok.encode(text)) == text


@pytest.fixture(scope="module")
def gpt3_run(tmp_path_factory):
    """A tiny GPT-3 (learned positions, which no HF format here describes) trained on bytes for 2 steps."""
    out = tmp_path_factory.mktemp("gpt3") / "run"
    r = T.train("gpt3-125m", overrides={"n_layers": 1, "d_model": 32, "vocab_size": 256, "max_seq_len": 32,
                                        "layers.*.mixer.n_heads": 4, "layers.*.mixer.n_kv_heads": 4,
                                        "layers.*.ffn.d_ff": 64}, out_dir=str(out), **RUN)
    return r


def test_a_model_no_format_describes_is_exported_in_zoos_layout_and_loads(gpt3_run):
    r = gpt3_run
    assert r.export == r.out_dir / "final"
    assert {p.name for p in r.export.iterdir()} >= {"spec.toml", "model.safetensors", "tokenizer.json"}
    from zoo.training.checkpointer import CheckpointWeights

    trained = zoo.build_model(zoo.get_spec(r.export / "spec.toml"), device="meta")
    trained.load_state_dict(dict(CheckpointWeights(r.checkpoint)), assign=True)
    ids = torch.randint(0, 256, (1, 12))
    for source in (r.out_dir, r.export):  # the run directory loads its export
        loaded = zoo.from_pretrained(source)
        torch.testing.assert_close(loaded(ids), trained(ids), rtol=0, atol=0)
    assert zoo.build(r.out_dir, device="meta").spec == trained.spec  # the architecture, fresh weights


def test_zoo_describe_and_generate_take_the_run_directory(gpt3_run, capsys):
    r = gpt3_run
    assert main(["describe", str(r.out_dir), "--json"]) == 0
    figures = json.loads(capsys.readouterr().out)
    assert figures["params"]["total"] == zoo.from_pretrained(r.out_dir).num_parameters()
    assert main(["generate", str(r.out_dir), "--prompt", "def ", "-n", "6", "--no-stop"]) == 0
    model = zoo.from_pretrained(r.out_dir)
    new = zoo.generate(model, torch.tensor([list(b"def ")]), 6)[0, 4:]
    assert capsys.readouterr().out == "def " + bytes(new.tolist()).decode("utf-8", "replace").rstrip("\ufffd") + "\n"


def test_generate_takes_a_tokenizer_for_a_checkpoint_without_one(tmp_path, capsys):
    tiny.make_tiny("llama", tmp_path, overrides={"vocab_size": 256})
    assert main(["generate", str(tmp_path), "--prompt", "x"]) == 2
    assert "--tokenizer bytes" in capsys.readouterr().err
    assert main(["generate", str(tmp_path), "--prompt", "ab", "-n", "5", "--no-stop", "--tokenizer", "bytes"]) == 0
    new = zoo.generate(zoo.from_pretrained(tmp_path), torch.tensor([list(b"ab")]), 5)[0, 2:]
    assert capsys.readouterr().out == "ab" + bytes(new.tolist()).decode("utf-8", "replace").rstrip("\ufffd") + "\n"


def test_describe_reads_a_checkpoint_directory_and_its_config_json_as_transformers_does(tmp_path, capsys):
    tiny.make_tiny("llama", tmp_path)
    params = zoo.from_pretrained(tmp_path).num_parameters()
    for source in (tmp_path, tmp_path / "config.json"):
        assert main(["describe", str(source), "--json"]) == 0
        assert json.loads(capsys.readouterr().out)["params"]["total"] == params


def with_tokenizer(directory):
    """A byte-level tokenizer with <eos>=2's place taken by the byte 2, a chat template, and BOS 1."""
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tok = HFTokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": alphabet[1], "eos_token": alphabet[2], "add_bos_token": True, "chat_template": TEMPLATE}))
    return directory


def test_save_pretrained_writes_the_tokenizer_so_generate_runs_on_the_result(tmp_path, capsys):
    src = tmp_path / "src"
    tiny.make_tiny("llama", src, overrides={"vocab_size": 256, "eos_token_id": 2, "bos_token_id": 1})
    with_tokenizer(src)
    zoo.save_pretrained(zoo.from_pretrained(src), tmp_path / "out")
    out = tmp_path / "out"
    assert {"tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json"} <= {
        p.name for p in out.iterdir()}
    gen = json.loads((out / "generation_config.json").read_text())
    assert gen["eos_token_id"] == 2 and gen["bos_token_id"] == 1
    back, orig = Tokenizer(out), Tokenizer(src)
    assert back.chat_template == TEMPLATE and back.encode("hi") == orig.encode("hi") and back.bos_id == 1
    assert main(["generate", str(out), "--prompt", "hi", "-n", "3", "--no-stop"]) == 0
    capsys.readouterr()


def test_init_from_exports_keep_the_chat_template_and_token_ids(tmp_path):
    src = tmp_path / "src"
    tiny.make_tiny("llama", src, overrides={"vocab_size": 256, "eos_token_id": 2, "bos_token_id": 1,
                                            "pad_token_id": 0})
    with_tokenizer(src)
    r = T.train(init_from=str(src), out_dir=str(tmp_path / "run"), **RUN)
    config = json.loads((r.export / "config.json").read_text())
    assert (config["bos_token_id"], config["eos_token_id"], config["pad_token_id"]) == (1, 2, 0)
    assert Tokenizer(r.export).chat_template == TEMPLATE
    assert json.loads((r.export / "generation_config.json").read_text())["eos_token_id"] == 2


def test_an_unfinished_run_says_how_to_get_its_export(tmp_path, capsys, monkeypatch):
    out = tmp_path / "run"
    T.train("llama3-8b", overrides={"n_layers": 1, "d_model": 32, "vocab_size": 256, "max_seq_len": 32,
                                    "layers.*.mixer.n_heads": 4, "layers.*.mixer.n_kv_heads": 4,
                                    "layers.*.ffn.d_ff": 64}, out_dir=str(out), stop_after=1, **RUN)
    assert (out / "checkpoints").is_dir() and not (out / "final").exists()
    with pytest.raises(Exception, match="without its final/ export yet"):
        zoo.from_pretrained(out)
    assert main(["describe", str(out)]) == 2
    assert "finish it with the same zoo train command" in capsys.readouterr().err
    monkeypatch.chdir(tmp_path)
    (tmp_path / "llama3-8b").mkdir()  # a folder is read as a checkpoint only when it holds one
    assert zoo.build("llama3-8b", device="meta").spec == zoo.get_spec("llama3-8b")


def test_zoos_layout_is_written_tensor_by_tensor_from_a_mapping(tmp_path):
    """save_native with state= writes from a meta model and a reader of one tensor at a time (the
    export of a training checkpoint) the same tensors as safetensors' save_model of the whole model,
    each read once; a parameter shared under two names (a plugin's tied head) is stored once, under
    the name save_model keeps, so load_model reads it."""
    from collections.abc import Mapping

    from safetensors import safe_open
    from safetensors.torch import load_model, save_model

    from zoo.checkpoints.files.native import save_native

    spec = zoo.get_spec("gpt3-125m", overrides={"n_layers": 2, "d_model": 32, "vocab_size": 64, "max_seq_len": 16,
                                               "layers.*.mixer.n_heads": 4, "layers.*.mixer.n_kv_heads": 4,
                                               "layers.*.ffn.d_ff": 64, "head.tied": False})
    model, plain = zoo.build_model(spec, seed=3), zoo.build_model(spec, device="meta")
    for m in (model, plain):
        m.lm_head.weight = m.embed.weight
    whole = {k: v.detach().clone() for k, v in model.state_dict().items()}
    read = []

    class Reader(Mapping):
        def __getitem__(self, name):
            read.append(name)
            return whole[name]

        def __iter__(self):
            return iter(whole)

        def __len__(self):
            return len(whole)

        def meta(self, name):
            return whole[name].to("meta")

    save_native(plain, tmp_path / "streamed", state=Reader())
    save_model(model, str(tmp_path / "reference.safetensors"))
    with safe_open(str(tmp_path / "streamed" / "model.safetensors"), "pt") as a, \
            safe_open(str(tmp_path / "reference.safetensors"), "pt") as b:
        tied = {k: v for k, v in a.metadata().items() if k != "format"}
        assert tied == b.metadata() == {"lm_head.weight": "embed.weight"}
        assert sorted(a.keys()) == sorted(b.keys()) == sorted(read) and len(read) == len(set(read))
        for name in b.keys():
            assert torch.equal(a.get_tensor(name), b.get_tensor(name)), name
    loaded = zoo.build_model(spec, seed=0)
    loaded.lm_head.weight = loaded.embed.weight
    load_model(loaded, str(tmp_path / "streamed" / "model.safetensors"), strict=True)
    ids = torch.randint(0, 64, (1, 10))
    torch.testing.assert_close(loaded(ids), model(ids), rtol=0, atol=0)

"""zoo.train in one process: the recipe, learning, z-loss, exact resumption, bad input."""

import importlib
import json
import math
import sys

import pytest
import torch

import zoo
from zoo.cli import main as cli
from zoo.training.checkpointer import CheckpointWeights
from zoo.training.data import ByteTokenizer, TokenData, load_tokens, unigram_entropy

T = importlib.import_module("zoo.training.loop")  # the module; `zoo.train` is the function

TINY = {"n_layers": 2, "d_model": 32, "vocab_size": 256, "max_seq_len": 64, "layers.*.mixer.n_heads": 4,
        "layers.*.mixer.n_kv_heads": 2, "layers.*.ffn.d_ff": 64}
QUIET = dict(progress=False, plot=False, export=False, cpu=True)
SMALL = dict(seq_len=16, **QUIET)


pytestmark = pytest.mark.usefixtures("one_thread")


def metrics(out_dir):
    return [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()]


def test_without_accelerate_zoo_train_names_the_extra_to_install(monkeypatch, tmp_path):
    """The README's main install (zoo-lm[reference]) has no accelerate: ``zoo train`` says which
    extra brings it, before any work is done, and stays a ModuleNotFoundError for callers."""
    monkeypatch.setitem(sys.modules, "accelerate", None)  # import accelerate now fails as if absent
    args = ["train", "llama3-8b", "--set", "n_layers=1", "--steps", "1", "--out-dir", str(tmp_path / "run")]
    with pytest.raises(ModuleNotFoundError, match=r"training needs accelerate.*pip install 'zoo-lm\[train\]'") as err:
        cli(args)
    assert err.value.name == "accelerate" and not (tmp_path / "run").exists()


def test_weight_decay_only_on_matrices_not_norms_biases_or_embeddings():
    model = zoo.build("gpt3-125m", n_layers=2, d_model=32, vocab_size=64,
                      overrides={"layers.*.mixer.n_heads": 4, "layers.*.ffn.d_ff": 64})
    decay, rest = T.param_groups(model, 0.1)
    names = {id(p): n for n, p in model.named_parameters()}
    decayed = {names[id(p)] for p in decay["params"]}
    kept = {names[id(p)] for p in rest["params"]}
    assert decay["weight_decay"] == 0.1 and rest["weight_decay"] == 0.0
    assert "layers.0.mixer.q_proj.weight" in decayed and "layers.1.ffn.down.weight" in decayed
    assert {"embed.weight", "positions.0.table.weight", "final_norm.weight", "final_norm.bias",
            "layers.0.attn_norm.weight", "layers.0.mixer.q_proj.bias"} <= kept
    assert decayed.isdisjoint(kept) and len(decayed) + len(kept) == len(names)


def test_weight_decay_is_what_a_parameter_is_not_its_rank_stacked_expert_biases_are_not_decayed():
    model = zoo.build("qwen3-30b-a3b", n_layers=2, d_model=32, vocab_size=64,
                      overrides={"layers.*.mixer.n_heads": 4, "layers.*.mixer.n_kv_heads": 2, "layers.*.mixer.head_dim": 8,
                                 "layers.*.ffn.n_experts": 4, "layers.*.ffn.top_k": 2, "layers.*.ffn.d_ff": 16,
                                 "layers.*.ffn.expert": {"name": "swiglu", "bias": True}})
    decay, rest = T.param_groups(model, 0.1)
    names = {id(p): n for n, p in model.named_parameters()}
    decayed = {names[id(p)] for p in decay["params"]}
    kept = {names[id(p)] for p in rest["params"]}
    assert model.get_parameter("layers.0.ffn.experts.b_up").ndim == 2  # stacked: rank would decay it
    assert {f"layers.0.ffn.experts.{n}" for n in ("b_gate", "b_up", "b_down")} <= kept
    assert {f"layers.0.ffn.experts.{n}" for n in ("w_gate", "w_up", "w_down")} | {"layers.0.ffn.router.weight"} <= decayed
    assert {"layers.0.mixer.q_norm.weight", "final_norm.weight", "embed.weight"} <= kept
    assert decayed.isdisjoint(kept) and len(decayed) + len(kept) == len(names)


def test_a_part_that_does_not_state_its_no_decay_parameters_keeps_the_rule_of_matrices():
    from torch import nn

    class Old(nn.Module):  # a plugin part written before parts stated them: adapted at registration
        def __init__(self):
            super().__init__()
            self.decay = nn.Parameter(torch.zeros(4))
            self.w = nn.Parameter(torch.zeros(4, 4))

    from zoo.core import kinds

    kinds.adapt(Old, kinds.Mixer)
    m = Old()
    decay, rest = T.param_groups(m, 0.1)
    assert decay["params"] == [m.w] and rest["params"] == [m.decay]


def test_schedule_warms_up_linearly_then_decays_by_cosine_to_the_floor():
    f = lambda s: T.lr_factor(s, warmup=10, total=110, min_ratio=0.1)  # noqa: E731
    assert f(0) == pytest.approx(0.1) and f(4) == pytest.approx(0.5) and f(9) == pytest.approx(1.0)
    assert f(10) == pytest.approx(1.0)
    assert f(60) == pytest.approx(0.1 + 0.9 * 0.5)  # half way through the cosine
    assert f(110) == pytest.approx(0.1) and f(500) == pytest.approx(0.1)


def test_data_order_is_a_function_of_the_position_only():
    tokens = torch.arange(1000) % 256
    data = TokenData(tokens, seq_len=10, seed=3)
    whole = data.batch(0, 250)  # two and a half epochs
    assert torch.equal(TokenData(tokens, 10, seed=3).batch(137, 40), whole[137:177])
    first_epoch = whole[:100]
    assert sorted(first_epoch[:, 0].tolist()) == sorted(tokens.view(100, 10)[:, 0].tolist())
    assert not torch.equal(whole[:100], whole[100:200])  # reshuffled each epoch


def test_loss_falls_well_below_unigram_entropy_and_z_loss_holds_log_partition_near_zero(tmp_path):
    """A few hundred steps on the built-in corpus: the model beats the best context-free model by a
    wide margin, and z-loss pulls the log-partition from log(256) at initialisation to near 0,
    where without it log Z drifts away. The coefficient is larger than PaLM's 1e-4 so that the
    effect shows within 300 steps rather than thousands."""
    entropy = unigram_entropy(load_tokens())
    kw = dict(overrides={**TINY, "d_model": 64, "layers.*.ffn.d_ff": 128}, seq_len=64, global_batch=8,
              micro_batch=8, lr=3e-3, warmup_steps=20, **QUIET)
    with_z = T.train("llama3-8b", steps=300, z_loss=0.05, out_dir=str(tmp_path / "z"), **kw)
    ce, z = sum(with_z.ce[-20:]) / 20, sum(with_z.z[-20:]) / 20
    assert 2.5 < entropy < 4.0  # bytes of Python source; the bounds below are relative to it
    assert ce < entropy - 0.7
    assert with_z.z[0] == pytest.approx(math.log(256) ** 2, rel=0.05)  # logits start near 0: log Z = log V
    assert z < 1.0  # |log Z| < 1
    without = T.train("llama3-8b", steps=100, z_loss=0.0, out_dir=str(tmp_path / "plain"), **kw)
    assert sum(without.ce[-20:]) / 20 < entropy  # it learns too, but
    assert sum(without.z[-20:]) / 20 > 25.0  # log Z stays around log V or beyond (|log Z| > 5)


def test_interrupted_and_resumed_run_follows_the_uninterrupted_trajectory(tmp_path, monkeypatch):
    """Stopped after 2 steps, resumed, killed while writing the step-6 checkpoint, resumed again
    (from step 3): the 8 losses are those of a run never interrupted."""
    from zoo.training import checkpointer

    kw = dict(overrides=TINY, steps=8, seq_len=32, global_batch=8, micro_batch=4, lr=3e-3, warmup_steps=3,
              weight_decay=0.1, **QUIET)
    T.train("llama3-8b", out_dir=str(tmp_path / "whole"), **kw)
    out = tmp_path / "parts"
    part = T.train("llama3-8b", out_dir=str(out), stop_after=2, **kw)
    assert part.step == 2 and part.checkpoint.name == "step-0000002"

    real_save = checkpointer._dcp_save

    def dies_writing_step_6(tensors, directory):
        if ".tmp-step-0000006" in str(directory) and directory.name == "optimizer":
            (directory / "shard-00001-model-00001-of-00001.safetensors").write_bytes(b"half a file")
            raise RuntimeError("killed while saving")
        return real_save(tensors, directory)

    monkeypatch.setattr(checkpointer, "_dcp_save", dies_writing_step_6)
    with pytest.raises(RuntimeError, match="killed while saving"):
        T.train("llama3-8b", out_dir=str(out), save_every=3, **kw)
    assert [p.name for p in T.checkpoints(out)] == ["step-0000002", "step-0000003"]  # no step 6: it never completed
    assert (out / "checkpoints" / ".tmp-step-0000006").is_dir()
    monkeypatch.setattr(checkpointer, "_dcp_save", real_save)

    rest = T.train("llama3-8b", out_dir=str(out), **kw)  # resume="auto": the latest complete checkpoint
    assert len(rest.losses) == 5 and rest.step == 8
    whole, parts = metrics(tmp_path / "whole"), metrics(out)
    assert [m["step"] for m in parts] == list(range(1, 9))
    for key in ("loss", "z", "lr"):
        assert [m[key] for m in parts] == pytest.approx([m[key] for m in whole], rel=1e-6, abs=0)
    ckpts = sorted(p.name for p in (out / "checkpoints").iterdir())
    assert ckpts == ["step-0000003", "step-0000008"]  # keep_last=2; the temporary directory is gone
    files = {p.name for p in (out / "checkpoints" / "step-0000008").iterdir()}
    assert files == {"model", "optimizer", "rng-rank00000.safetensors", "state.json"}


def test_trains_on_user_files_with_a_tokenizer_json_and_writes_plot_and_export(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    text = "the cat sat on the mat and the dog sat on the log. " * 200
    (tmp_path / "a.txt").write_text(text)
    tok = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator([text], trainers.WordLevelTrainer(special_tokens=["[UNK]"]))
    tok.save(str(tmp_path / "tokenizer.json"))
    r = T.train("llama3-8b", overrides={**TINY, "vocab_size": 16}, steps=30, seq_len=16, global_batch=4,
                micro_batch=4, lr=1e-2, warmup_steps=3, data=(str(tmp_path / "a.txt"),),
                tokenizer=str(tmp_path / "tokenizer.json"), out_dir=str(tmp_path / "run"), progress=False, cpu=True)
    assert r.losses[-1] < 0.5 * r.losses[0]  # a 12-word periodic text is easy
    assert r.plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (r.export / "tokenizer.json").is_file()
    back = zoo.from_pretrained(str(r.export))
    ids = torch.randint(0, 12, (1, 8))
    final = zoo.build_model(back.spec, device="meta")
    final.load_state_dict(dict(CheckpointWeights(r.checkpoint)), assign=True)
    torch.testing.assert_close(back(ids), final(ids))


def test_init_from_a_checkpoint_starts_from_its_weights(tmp_path):
    model = zoo.build("llama3-8b", seed=7, **{k.replace(".", "__").replace("*", "default"): v for k, v in TINY.items()})
    zoo.save_pretrained(model, tmp_path / "pre", model_type="llama")
    r = T.train(init_from=str(tmp_path / "pre"), steps=2, seq_len=16, global_batch=4, micro_batch=4, lr=0.0,
                out_dir=str(tmp_path / "run"), **QUIET)
    first = TokenData(load_tokens(), 16, seed=0).batch(0, 4)  # what step 1 read
    with torch.no_grad():
        assert r.losses[0] == pytest.approx(float(model.loss(first).loss), rel=1e-5)
    after = CheckpointWeights(r.checkpoint)  # lr 0: the weights did not move
    for name, tensor in model.state_dict().items():
        torch.testing.assert_close(after[name], tensor, rtol=0, atol=0)


# -- bad input: a clear error before any compute ----------------------------------------------------

@pytest.fixture
def no_compute(monkeypatch):
    def refuse(*a, **k):
        raise AssertionError("a model was built: the error came too late")

    monkeypatch.setattr(T, "build_model", refuse)


def test_missing_or_empty_corpus_file_fails_first(tmp_path, no_compute):
    with pytest.raises(FileNotFoundError, match=r"corpus file .*nope\.txt does not exist"):
        T.train("llama3-8b", overrides=TINY, data=(str(tmp_path / "nope.txt"),), out_dir=str(tmp_path), **SMALL)
    (tmp_path / "empty.txt").write_text("  \n")
    with pytest.raises(ValueError, match=r"corpus file .*empty\.txt is empty"):
        T.train("llama3-8b", overrides=TINY, data=(str(tmp_path / "empty.txt"),), out_dir=str(tmp_path), **SMALL)


def test_batch_sizes_that_do_not_divide_fail_first(tmp_path, no_compute):
    with pytest.raises(ValueError, match=r"global_batch 10 is not divisible by processes \(1\) x micro_batch \(4\)"):
        T.train("llama3-8b", overrides=TINY, global_batch=10, micro_batch=4, out_dir=str(tmp_path), **SMALL)
    with pytest.raises(ValueError, match=r"x grad_accum \(3\)"):
        T.train("llama3-8b", overrides=TINY, global_batch=8, micro_batch=4, grad_accum=3, out_dir=str(tmp_path), **SMALL)


def test_tokenizer_larger_than_the_vocabulary_fails_first(tmp_path, no_compute):
    with pytest.raises(ValueError, match=r"tokenizer has 256 tokens but the model's vocab_size is 100; set vocab_size=256"):
        T.train("llama3-8b", overrides={**TINY, "vocab_size": 100}, out_dir=str(tmp_path), **SMALL)


def test_checkpoint_of_another_model_fails_first(tmp_path, monkeypatch):
    T.train("llama3-8b", overrides=TINY, steps=1, seq_len=16, global_batch=2, micro_batch=2,
            out_dir=str(tmp_path), **QUIET)
    monkeypatch.setattr(T, "build_model", lambda *a, **k: pytest.fail("built a model before checking the checkpoint"))
    with pytest.raises(ValueError, match=r"step-0000001 was written for another model \(d_model: 32 in the checkpoint, 64 now"):
        T.train("llama3-8b", overrides={**TINY, "d_model": 64}, steps=2, seq_len=16, global_batch=2,
                micro_batch=2, out_dir=str(tmp_path), **QUIET)


def test_cli_reports_bad_input_without_a_traceback(tmp_path, capsys):
    rc = cli(["train", "llama3-8b", "--set", "vocab_size=256", "--data", str(tmp_path / "missing.txt"),
              "--out-dir", str(tmp_path), "--cpu", "--no-progress"])
    assert rc == 2
    assert "missing.txt does not exist" in capsys.readouterr().err


def test_byte_tokenizer_round_trips():
    tok = ByteTokenizer()
    text = "naïve café → ok"
    assert tok.decode(tok.encode(text)) == text and max(tok.encode(text)) < 256

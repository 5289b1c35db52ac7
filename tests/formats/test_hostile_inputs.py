"""Hostile inputs: ablation files that would write outside their folder, config fields that would hang
or allocate, numbers that would load silently wrong, and files that would block a reader. Each is
refused with an error naming the field, tensor or file (a size bound also states its limit)."""

import json
import math
import os
import signal
import stat
import subprocess
import types
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import zoo
from zoo.checkpoints import CheckpointError, ConfigError, check_layers, config_to_spec, get_format
from zoo.checkpoints.tiny import tiny_config
from zoo.core.spec import SpecError
from zoo.testing import part
from zoo.tools import ablate
from zoo.training.config import TrainConfig

pytestmark = pytest.mark.usefixtures("one_thread")

ABLATION = {
    "ablation": {"base": "llama3-8b", "lrs": [1e-3], "seeds": [0]},
    "set": {"n_layers": 1, "d_model": 32, "vocab_size": 256, "max_seq_len": 32, "layers.*.mixer.n_heads": 2,
            "layers.*.mixer.n_kv_heads": 2, "layers.*.ffn.d_ff": 64},
    "train": {"steps": 2, "seq_len": 16, "global_batch": 2, "micro_batch": 2, "warmup_steps": 0, "cpu": True},
    "variants": {"base": {}},
}


def ablation(**head):
    data = json.loads(json.dumps(ABLATION))
    data["ablation"].update(head)
    return data


@contextmanager
def finishes_within(seconds):
    """Fail (rather than hang the suite) when the body runs past ``seconds``: a guard for work that must
    be bounded, set far above what it takes (it is no speed test)."""
    def expired(*_):
        raise TimeoutError(f"still running after {seconds} s")

    old = signal.signal(signal.SIGALRM, expired)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


# -- ablation files -----------------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["../../../../x", "/tmp/elsewhere", "a/b", "..", ".", ".hidden", ""])
def test_a_variant_name_that_leaves_the_output_folder_is_refused(name):
    data = ablation()
    data["variants"] = {name: {}}
    with pytest.raises(ablate.AblationError, match="variant .*plain folder name"):
        ablate.from_dict(data)


@pytest.mark.parametrize("name", ["../../../x", "/abs", "a/../../b", 3])
def test_an_ablation_name_that_moves_the_default_folder_is_refused(name):
    with pytest.raises(ablate.AblationError, match=r"\[ablation\]\.name .*plain folder name"):
        ablate.from_dict(ablation(name=name))


def test_learning_rates_that_print_alike_get_their_own_run_folders(tmp_path):
    a, b = 1e-3, 1.0000001e-3
    assert f"{a:g}" == f"{b:g}"
    ab = ablate.from_dict(ablation(lrs=[a, b]))
    specs = {"base": zoo.get_spec(ab.base, ab.overrides("base"))}
    dirs = [row[3] for row in ablate.plan(ab, specs, tmp_path)]
    assert len(set(dirs)) == 2
    assert all(d.resolve().is_relative_to(tmp_path.resolve()) for d in dirs)


@pytest.mark.parametrize("field, values", [("lrs", [1e-3, 0.001]), ("lrs", [1e-2, 3, 1e-2]), ("seeds", [0, 1, 0])])
def test_a_grid_that_lists_a_value_twice_is_refused(field, values):
    with pytest.raises(ablate.AblationError, match=rf"\[ablation\]\.{field} lists .* twice"):
        ablate.from_dict(ablation(**{field: values}))


@pytest.mark.parametrize("value", [float("nan"), -1.0, 0, float("inf"), "10", True])
def test_diverge_loss_must_be_a_positive_finite_loss(value):
    with pytest.raises(ablate.AblationError, match=r"\[ablation\]\.diverge_loss"):
        ablate.from_dict(ablation(diverge_loss=value))


@pytest.mark.parametrize("key, value", [("cpu", "no"), ("steps", 2.5), ("steps", "2"), ("lr", "1e-3"),
                                        ("progress", 1), ("data", "corpus.txt")])
def test_train_settings_of_the_wrong_type_are_refused_naming_the_field(key, value):
    if key != "data":
        with pytest.raises(ValueError, match=rf"TrainConfig\.{key} must be"):
            TrainConfig(**{key: value}).check()
    data = ablation()
    data["train"][key] = value
    with pytest.raises(ablate.AblationError, match=rf"\b{key}\b"):
        ab = ablate.from_dict(data)
        ablate.check(ab)


def test_a_sweep_killed_after_its_last_checkpoint_runs_again(tmp_path):
    """Killed between the run's final checkpoint and its result.json: the run is not done, and running
    again starts it afresh instead of refusing a folder that holds a run."""
    ab = ablate.from_dict(ablation())
    out = tmp_path / "out"
    (run,) = [row[3] for row in ablate.plan(ab, ablate.check(ab), out)]
    left = run / "checkpoints" / "step-0000002"
    left.mkdir(parents=True)
    (left / "state.json").write_text("{}")
    summary = ablate.sweep(ab, out, report=False, echo=lambda line: None)
    assert summary["variants"]["base"]["runs"] == 1
    assert (run / "result.json").is_file() and not (run / "checkpoints").exists()


# -- config fields that would hang or allocate --------------------------------------------------------

def layer_names(fmt, spec):
    """Every HF tensor name the format's rules give ``spec`` (each per-layer name for each layer)."""
    names = []
    for r in fmt.rules(spec):
        for h in r.hf:
            names += [h.replace("{i}", str(i)) for i in range(spec.n_layers)] if r.per_layer else [h]
    return names


def test_the_layer_check_over_16000_experts_is_linear():
    """16,000 experts in 2 layers (96,000 names): the check once matched every name against one regex of
    every expert's name (144 s); it is a look-up per name now."""
    config = {"model_type": "qwen3_moe", **tiny_config("qwen3_moe", num_experts=16000, num_hidden_layers=2)}
    spec, fmt = config_to_spec(config), get_format("qwen3_moe")
    names = layer_names(fmt, spec)
    assert len(names) > 96000
    files = types.SimpleNamespace(names=lambda: names, directory="<names>")
    with finishes_within(60):
        check_layers(spec, fmt, files)
        fewer = [n for n in names if not n.startswith("model.layers.1.")]
        with pytest.raises(CheckpointError, match=r"describes 2 layers, but the weights hold layers 0\.\.0"):
            check_layers(spec, fmt, types.SimpleNamespace(names=lambda: fewer, directory="<names>"))


@pytest.mark.parametrize("model_type, field", [("llama", "head_dim"), ("qwen3", "head_dim")])
def test_a_huge_head_dim_is_refused_stating_the_limit(model_type, field):
    config = {"model_type": model_type, **tiny_config(model_type, **{field: 2 ** 30})}
    with pytest.raises((ConfigError, SpecError), match=r"head_dim: 1073741824 is beyond zoo's limit of 65,536"):
        config_to_spec(config)


def test_a_rotary_dim_beyond_the_limit_is_refused_before_any_table_is_computed():
    with pytest.raises(SpecError, match=r"rotary_dim: 2147483648 .* beyond zoo's limit of 65,536"):
        zoo.get_spec("llama3-8b", {"position.rotary_dim": 2 ** 31, "layers.*.mixer.head_dim": 2 ** 16})


def test_num_nextn_predict_layers_is_bounded_stating_the_limit():
    config = {"model_type": "deepseek_v3", **tiny_config("deepseek_v3", num_nextn_predict_layers=10_000)}
    with finishes_within(60), pytest.raises(ConfigError, match=r"'num_nextn_predict_layers'.*10000 is beyond zoo's "
                                                                 r"limit of 64"):
        config_to_spec(config)
    with pytest.raises(SpecError, match="mtp.depth: 65 is beyond zoo's limit of 64"):
        zoo.get_spec("llama3-8b", {"mtp": {"depth": 65}})


# -- FP8 checkpoints: block sizes and scales ----------------------------------------------------------

def fp8_checkpoint(src, dst, *, block=(32, 32), scale_value=None):
    """``src`` (a tiny llama transformers wrote) with its layers' projections stored as float8 and a scale
    per block; ``scale_value`` replaces the first entry of layer 0's q_proj scale."""
    tensors = {}
    for name, t in load_file(src / "model.safetensors").items():
        if name.startswith("model.layers.") and name.endswith("_proj.weight"):
            rows, cols = t.shape
            grid = (-(-rows // block[0]), -(-cols // block[1]))
            tensors[name] = t.to(torch.float8_e4m3fn)
            tensors[name + "_scale_inv"] = torch.ones(grid)
        else:
            tensors[name] = t
    if scale_value is not None:
        tensors["model.layers.0.self_attn.q_proj.weight_scale_inv"][0, 0] = scale_value
    dst.mkdir()
    config = json.loads((src / "config.json").read_text())
    quant = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": list(block)}
    (dst / "config.json").write_text(json.dumps({**config, "quantization_config": quant}))
    save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
    return dst


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    pytest.importorskip("transformers")
    from zoo.checkpoints.tiny import make_tiny

    path = tmp_path_factory.mktemp("llama")
    make_tiny("llama", path, std=0.05)
    return path


FP8_MODES = pytest.mark.parametrize("mode", ["dequantize", "keep"])  # from_pretrained(fp8=...)


@FP8_MODES
def test_an_fp8_block_larger_than_every_weight_is_refused(tiny_llama, tmp_path, mode):
    """A block of 2^20 rows matches a one-entry scale grid, and each scale would be widened to 2^20 rows
    (at [1e9, 1e9], 4 GB per weight)."""
    fp8 = fp8_checkpoint(tiny_llama, tmp_path / "fp8", block=(1 << 20, 1 << 20))
    with pytest.raises(CheckpointError, match=r"weight_block_size \[1048576, 1048576\] has blocks of 1048576 rows"):
        zoo.from_pretrained(fp8, progress=False, fp8=mode)


def test_an_fp8_block_within_the_weights_loads(tiny_llama, tmp_path):
    model = zoo.from_pretrained(fp8_checkpoint(tiny_llama, tmp_path / "fp8"), progress=False)
    stored = load_file(tiny_llama / "model.safetensors")["model.layers.0.self_attn.q_proj.weight"]
    torch.testing.assert_close(model.layers[0].mixer.q_proj.weight, stored.to(torch.float8_e4m3fn).float(),
                               atol=0, rtol=0)


@FP8_MODES
@pytest.mark.parametrize("value", [float("nan"), float("inf"), -1.0])
def test_an_fp8_scale_that_is_nan_infinite_or_negative_is_refused_naming_it(tiny_llama, tmp_path, value, mode):
    fp8 = fp8_checkpoint(tiny_llama, tmp_path / "fp8", scale_value=value)
    with pytest.raises(CheckpointError, match=r"scale 'model\.layers\.0\.self_attn\.q_proj\.weight_scale_inv' holds"):
        zoo.from_pretrained(fp8, progress=False, fp8=mode)


# -- MiniMax's decay tables ---------------------------------------------------------------------------

def test_a_minimax_block_size_that_contradicts_the_stored_decay_tables_is_refused(tmp_path):
    pytest.importorskip("transformers")
    from zoo.checkpoints.tiny import make_tiny

    make_tiny("minimax", tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["block_size"] == 6
    zoo.from_pretrained(tmp_path, progress=False)  # as written: loads
    (tmp_path / "config.json").write_text(json.dumps({**config, "block_size": 1 << 20}))
    with pytest.raises(CheckpointError, match=r"query_decay has the shape \(4, 6, 1\), but block_size 1048576"):
        zoo.from_pretrained(tmp_path, progress=False)


# -- MoE settings that cannot be right ----------------------------------------------------------------

@pytest.mark.parametrize("field, value, message", [
    ("routed_scaling", 0.0, "must be positive"), ("routed_scaling", -2.5, "must be positive"),
    ("routed_scaling", float("nan"), "finite"),
    ("bias_rate", -0.001, "must be >= 0"), ("bias_rate", float("inf"), "finite"),
    ("capacity_factor", 1e308, r"beyond its limit n_experts / top_k = 4"),
])
def test_moe_settings_that_cannot_be_right_are_refused_naming_the_field(field, value, message):
    with pytest.raises(SpecError, match=rf"^ffn\.{field}: .*{message}"):
        part("ffn", "moe", {"n_experts": 8, "top_k": 2, field: value})
    part("ffn", "moe", {"n_experts": 8, "top_k": 2, "capacity_factor": 4.0})  # the limit itself is fine


def test_a_deepseek_routed_scaling_factor_of_zero_is_refused():
    config = {"model_type": "deepseek_v3", **tiny_config("deepseek_v3", routed_scaling_factor=0.0)}
    with pytest.raises(SpecError, match="routed_scaling: must be positive"):
        config_to_spec(config)


# -- zero periods and sizes: an error naming the field, not ZeroDivisionError -------------------------

SSM = {"d_model": 64, "n_layer": 2, "vocab_size": 100, "ssm_cfg": {"layer": "Mamba2"}}


@pytest.mark.parametrize("config, field", [
    ({"model_type": "qwen2_moe", **tiny_config("qwen2_moe", decoder_sparse_step=0)}, "decoder_sparse_step"),
    ({"model_type": "qwen3_next", **{k: v for k, v in tiny_config("qwen3_next", full_attention_interval=0).items()
                                     if k != "layer_types"}}, "full_attention_interval"),
    *[({**SSM, "ssm_cfg": {"layer": "Mamba2", k: 0}}, f"ssm_cfg.{k}")
      for k in ("headdim", "expand", "d_state", "ngroups", "d_conv", "chunk_size")],
    ({**SSM, "pad_vocab_size_multiple": 0}, "pad_vocab_size_multiple"),
    ({**SSM, "d_model": 0}, "d_model"),
])
def test_a_zero_period_or_size_is_an_error_naming_the_field(config, field):
    with pytest.raises(ConfigError, match="must be a positive integer") as info:
        config_to_spec(config)
    assert info.value.field == field


@pytest.mark.parametrize("ssm, field", [
    ({"dt_min": -1.0}, "ssm_cfg.dt_min"), ({"dt_limit": [1.0, 0.5]}, "ssm_cfg.dt_limit"),
    ({"headdim": 48}, "ssm_cfg.headdim"), ({"dt_init_floor": -1.0}, "ssm_cfg.dt_init_floor"),
])
def test_mamba_ssm_errors_name_the_mamba_ssm_field(ssm, field):
    with pytest.raises(ConfigError) as info:
        config_to_spec({**SSM, "ssm_cfg": {"layer": "Mamba2", **ssm}})
    assert info.value.field == field and "(mamba_ssm)" in str(info.value)


@pytest.mark.parametrize("model_type, key, value", [
    ("mamba2", "head_dim", 0), ("mamba2", "num_heads", 0), ("mamba2", "expand", 0),
    ("nemotron_h", "mamba_num_heads", 0), ("nemotron_h", "mamba_head_dim", 0), ("nemotron_h", "ssm_state_size", 0),
    ("nemotron_h", "n_groups", 0), ("nemotron_h", "chunk_size", 0), ("nemotron_h", "num_attention_heads", 0),
    ("nemotron_h", "num_key_value_heads", 3), ("nemotron_h", "head_dim", 0), ("nemotron_h", "intermediate_size", 0),
    ("nemotron_h", "time_step_min", -1.0), ("nemotron_h", "layer_norm_epsilon", -1.0),
])
def test_mamba2_and_nemotron_h_errors_name_the_config_field(model_type, key, value):
    with pytest.raises(ConfigError) as info:
        config_to_spec({"model_type": model_type, **tiny_config(model_type, **{key: value})})
    assert info.value.field == key


# -- files that would block a reader, and the mode of written files -----------------------------------

def test_resume_auto_skips_a_fifo_among_the_checkpoint_files(tmp_path):
    """A FIFO named like a checkpoint's weights would block the open forever; it is refused unopened.
    (Should the check be missing, a writer opens the FIFO after 20 s, so that the test fails, not hangs.)"""
    from zoo.training.checkpointer import checkpoints
    from zoo.training.resume import resume_point

    step = tmp_path / "checkpoints" / "step-0000001"
    step.mkdir(parents=True)
    (step / "state.json").write_text(json.dumps({"step": 1, "data_position": 0, "spec": {}, "scheduler": {},
                                                 "optimizer": {}, "sharded": False, "processes": 1}))
    for name in ("optimizer.safetensors", "rng-rank00000.safetensors"):
        save_file({"x": torch.zeros(1)}, step / name)
    fifo = step / "model.safetensors"
    os.mkfifo(fifo)

    # Another process, since a blocked open may hold the GIL.
    writer = subprocess.Popen(["sh", "-c", f"sleep 20; : > '{fifo}'"])
    try:
        with pytest.warns(UserWarning, match=r"model\.safetensors.*is a FIFO, not a regular file"), \
                pytest.raises(ValueError, match="no complete checkpoint"):
            resume_point(TrainConfig(resume="auto", out_dir=str(tmp_path)), tmp_path, checkpoints(tmp_path))
    finally:
        writer.kill()
        writer.wait()


@pytest.mark.parametrize("umask", [0o022, 0o002], ids=["022", "002"])
def test_an_exported_gguf_file_has_the_mode_the_umask_gives(tmp_path, umask):
    pytest.importorskip("gguf")
    from zoo.checkpoints.files.gguf_out import save_gguf

    model = zoo.build("llama3.2-1b", overrides={"n_layers": 1, "d_model": 32, "vocab_size": 64, "layers.*.mixer.n_heads": 2,
                                                 "layers.*.mixer.n_kv_heads": 1, "layers.*.ffn.d_ff": 64,
                                                 "position.scaling": None}, seed=0)
    old = os.umask(umask)
    try:
        path = save_gguf(model, tmp_path / "model.gguf", model_type="llama")
        zoo.save_pretrained(model, tmp_path / "hf", model_type="llama")
    finally:
        os.umask(old)
    for written in (path, tmp_path / "hf" / "model.safetensors", tmp_path / "hf" / "config.json"):
        assert stat.S_IMODE(os.stat(written).st_mode) == 0o666 & ~umask, written


# -- GGUF headers whose counts outrun the file ----------------------------------------------------

def gguf_header(*entries, n_tensors=0, tail=b""):
    """A GGUF v3 header (little-endian) holding the metadata ``entries`` (raw bytes each), padded to 128."""
    import struct

    body = b"GGUF" + struct.pack("<IQQ", 3, n_tensors, len(entries)) + b"".join(entries) + tail
    return body + b"\0" * max(0, 128 - len(body))


def gguf_key(key: str) -> bytes:
    import struct

    return struct.pack("<Q", len(key)) + key.encode()


def test_a_gguf_array_claiming_2_62_items_is_refused_at_once(tmp_path):
    """128 bytes: an array of UINT32 claiming 2**62 items. gguf's reader loops over the claimed count
    (reading past the end as empty, its memory growing); zoo checks the count against the bytes left."""
    import struct

    pytest.importorskip("gguf")
    from zoo.checkpoints.files.gguf import GGUFFile

    path = tmp_path / "bomb.gguf"
    path.write_bytes(gguf_header(gguf_key("general.xxxx") + struct.pack("<IIQ", 9, 4, 2 ** 62)))
    assert path.stat().st_size == 128
    with finishes_within(20), pytest.raises(CheckpointError, match=r"bomb\.gguf: metadata key 'general\.xxxx' claims "
                                                                    r"an array of 4,611,686,018,427,387,904 items"):
        GGUFFile(path)


@pytest.mark.parametrize("entry, tensors, match", [
    (lambda s: gguf_key("k") + s.pack("<IIQ", 9, 8, 1000), 0, r"'k' claims an array of 1,000 items, but only"),
    (lambda s: gguf_key("k") + s.pack("<IQ", 8, 2 ** 40), 0, r"'k' \(a string\) claims 1,099,511,627,776 bytes"),
    (lambda s: gguf_key("k") + s.pack("<IIQ", 9, 4, 2000), 0, r"'k' \(an array of 2,000 items\) claims 8,000 bytes"),
    (lambda s: s.pack("<Q", 2 ** 63), 0, r"metadata entry 0's key \(a string\) claims"),
    (lambda s: gguf_key("k") + s.pack("<I", 99), 0, r"'k' has value type 99"),
    (lambda s: gguf_key("k") + s.pack("<IIQ", 9, 9, 1) + s.pack("<IQ", 9, 1) * 5, 0, r"'k' nests arrays deeper"),
    (lambda s: gguf_key("k") + s.pack("<IB", 0, 1), 2 ** 50, r"claims 1,125,899,906,842,624 tensors"),
    (lambda s: gguf_key("k") + s.pack("<IB", 0, 1) + gguf_key("t") + s.pack("<I", 2 ** 31), 1,
     r"tensor 't' claims 2,147,483,648 dimensions"),
])
def test_every_gguf_count_and_length_is_checked_against_the_bytes_left(tmp_path, entry, tensors, match):
    import struct

    pytest.importorskip("gguf")
    from zoo.checkpoints.files.gguf import GGUFFile

    path = tmp_path / "bad.gguf"
    path.write_bytes(gguf_header(entry(struct), n_tensors=tensors))
    with finishes_within(20), pytest.raises(CheckpointError, match=r"bad\.gguf: .*" + match):
        GGUFFile(path)


# -- layer counts bounded as they are read ---------------------------------------------------------

LAYER_KEYS = ("num_hidden_layers", "n_layer", "n_layers", "num_layers")


def layer_count_cases():
    from zoo.core import registry

    cases = [("mamba_ssm", {**SSM}, "n_layer")]
    for model_type in sorted(registry.registry("checkpoint_format").names()):
        try:
            config = tiny_config(model_type)
        except Exception:  # a format without a tiny config (a wrapper of another's)
            continue
        cases += [(model_type, {"model_type": model_type, **config}, k) for k in LAYER_KEYS if k in config]
    return cases


@contextmanager
def allocates_at_most(mib):
    import tracemalloc

    tracemalloc.start()
    try:
        yield
    finally:
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
    assert peak < mib * 2 ** 20, f"allocated {peak / 2 ** 20:.0f} MiB"


@pytest.mark.parametrize("model_type, config, key", layer_count_cases(), ids=lambda v: v if isinstance(v, str) else "")
def test_a_layer_count_of_ten_million_is_refused_when_read(model_type, config, key):
    """``[FULL] * n_layers`` and per-layer loops ran before the spec's bound (16 GB at 2e9): the count
    is bounded when the field is read, before anything is made of it."""
    with finishes_within(20), allocates_at_most(16), pytest.raises(ConfigError) as info:
        config_to_spec({**config, key: 10 ** 7})
    assert info.value.field == key and "10000000 is beyond zoo's limit of 4,096" in str(info.value)


def test_a_gguf_block_count_of_a_hundred_million_is_refused_when_read(tmp_path):
    pytest.importorskip("gguf")
    from zoo.checkpoints.files.gguf import GGUFFile

    model = zoo.build("llama3.2-1b", overrides={"n_layers": 1, "d_model": 32, "vocab_size": 64, "layers.*.mixer.n_heads": 2,
                                                 "layers.*.mixer.n_kv_heads": 1, "layers.*.ffn.d_ff": 64,
                                                 "position.scaling": None}, seed=0)
    path = zoo.save_gguf(model, tmp_path / "model.gguf", model_type="llama")
    data = bytearray(path.read_bytes())
    at = bytes(data).find(b"llama.block_count") + len("llama.block_count") + 4  # after the key and its type (UINT32)
    assert int.from_bytes(data[at:at + 4], "little") == 1
    data[at:at + 4] = (10 ** 8).to_bytes(4, "little")
    (tmp_path / "deep.gguf").write_bytes(bytes(data))
    with finishes_within(20), allocates_at_most(64), \
            pytest.raises(CheckpointError, match=r"deep\.gguf: metadata key 'llama\.block_count' = 100000000 is not a size"):
        GGUFFile(tmp_path / "deep.gguf").config()

"""Checkpoint directories as people really have them: saving next to other content, saves that are
killed or run at once, and bad or malicious files. Each test builds its own directory, checks the
error's type and that it names the culprit, and that nothing outside the target changed."""

import importlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import zoo
from zoo.checkpoints import CheckpointError, ConfigError, config_to_spec

TINY = {"model_type": "llama", "vocab_size": 96, "hidden_size": 32, "intermediate_size": 48,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 12,
        "max_position_embeddings": 64, "rms_norm_eps": 1e-5, "tie_word_embeddings": False,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}}
SHARDED = "10KB"  # the tiny model in several shards


def tiny(seed=0):
    return zoo.build_model(config_to_spec(TINY), seed=seed)


def same_weights(a, b):
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


def snapshot(root: Path, skip: Path = None) -> dict:
    """Every path under ``root`` (but ``skip``) with its mode and, for files, its bytes."""
    out = {}
    for p in sorted(root.rglob("*")):
        if skip is not None and (p == skip or skip in p.parents):
            continue
        st = p.lstat()
        out[str(p.relative_to(root))] = (st.st_mode, p.read_bytes() if p.is_file() and not p.is_symlink() else None)
    return out


def leftovers(d: Path) -> list[str]:
    return sorted(p.name for p in d.iterdir() if p.name.startswith(".zoo-"))


@pytest.fixture
def ckpt(tmp_path):
    d = tmp_path / "ckpt"
    zoo.save_pretrained(tiny(), d, model_type="llama")
    return d


# -- saving -------------------------------------------------------------------------------------


def test_save_keeps_unrelated_content_and_the_directory_mode(tmp_path):
    d = tmp_path / "project"
    (d / ".git").mkdir(parents=True)
    (d / ".git" / "HEAD").write_text("ref: refs/heads/main\n")
    (d / "src").mkdir()
    (d / "src" / "main.py").write_text("print('hi')\n")
    (d / "lora").mkdir()
    (d / "lora" / "adapter_model.safetensors").write_bytes(b"not mine")
    (d / "adapter_model.safetensors").write_bytes(b"an adapter")
    (d / "tokenizer.json").write_text("{}")
    d.chmod(0o751)
    zoo.save_pretrained(tiny(0), d, model_type="llama", max_shard_size=SHARDED)
    before = snapshot(d)
    zoo.save_pretrained(tiny(1), d, model_type="llama")  # sharded -> one file: the old shards go
    after = snapshot(d)
    own = lambda n: n == "config.json" or n.startswith("model")  # noqa: E731  (top-level checkpoint files)
    assert {n: v for n, v in after.items() if not own(n)} == {n: v for n, v in before.items() if not own(n)}
    assert sorted(n for n in after if own(n)) == ["config.json", "model.safetensors"]
    assert d.stat().st_mode & 0o777 == 0o751
    assert same_weights(tiny(1), zoo.from_pretrained(d))


def test_save_into_the_working_directory(tmp_path, monkeypatch):
    (tmp_path / "work" / ".git").mkdir(parents=True)
    (tmp_path / "work" / "src").mkdir()
    (tmp_path / "work" / "src" / "a.py").write_text("x = 1\n")
    monkeypatch.chdir(tmp_path / "work")
    before = snapshot(tmp_path / "work")
    zoo.save_pretrained(tiny(), ".", model_type="llama")
    after = snapshot(tmp_path / "work")
    assert {n: v for n, v in after.items() if n in before} == before
    assert sorted(set(after) - set(before)) == ["config.json", "model.safetensors"]


def test_failed_save_removes_only_a_directory_it_created(tmp_path, monkeypatch):
    def boom(*a, **k):
        raise OSError("disk full")

    monkeypatch.setattr("zoo.checkpoints.files.io.create_shard", boom)
    with pytest.raises(OSError, match="disk full"):
        zoo.save_pretrained(tiny(), tmp_path / "new" / "ckpt", model_type="llama")
    assert not (tmp_path / "new" / "ckpt").exists()
    (tmp_path / "empty").mkdir()
    with pytest.raises(OSError, match="disk full"):
        zoo.save_pretrained(tiny(), tmp_path / "empty", model_type="llama")
    assert (tmp_path / "empty").is_dir() and list((tmp_path / "empty").iterdir()) == []


SAVER = r"""
import json, os, signal, sys, time
import zoo
import zoo.checkpoints.files.io as io
mode, target, seed, arg, shard = sys.argv[1:6]
model = zoo.build_model(zoo.checkpoints.config_to_spec(json.loads(os.environ["ZOO_TEST_CONFIG"])), seed=int(seed))
calls = [0]
if mode == "kill-writing":  # killed while writing its second shard: before the commit
    real_save = io.create_shard
    def create_shard(*a, **k):
        calls[0] += 1
        if calls[0] == 2:
            os.kill(os.getpid(), signal.SIGKILL)
        return real_save(*a, **k)
    io.create_shard = create_shard
elif mode == "kill-applying":  # killed after the commit, with one new file moved in
    real_replace = os.replace
    def replace(a, b):
        real_replace(a, b)
        calls[0] += 1
        if calls[0] == 2:
            os.kill(os.getpid(), signal.SIGKILL)
    os.replace = replace
elif mode == "hold":  # holds the save open until the file `arg` exists
    real_save = io.create_shard
    def create_shard(*a, **k):
        open(arg + ".started", "w").close()
        while not os.path.exists(arg):
            time.sleep(0.02)
        return real_save(*a, **k)
    io.create_shard = create_shard
zoo.save_pretrained(model, target, model_type="llama", max_shard_size=shard)
"""


def saver(mode, target, seed, arg="-", shard=SHARDED):
    env = {**os.environ, "ZOO_TEST_CONFIG": json.dumps(TINY)}
    return subprocess.Popen([sys.executable, "-c", SAVER, mode, str(target), str(seed), str(arg), shard], env=env,
                            stderr=subprocess.PIPE, text=True)


def test_killed_saves_leave_the_old_checkpoint_and_their_temporary_files_go(ckpt):
    outside = snapshot(ckpt.parent, skip=ckpt)
    for seed in (1, 2):
        proc = saver("kill-writing", ckpt, seed)
        proc.wait(timeout=120)
        assert proc.returncode == -signal.SIGKILL, proc.stderr.read()
    assert len(leftovers(ckpt)) == 1  # the second save cleared the first one's staging directory
    assert same_weights(tiny(0), zoo.from_pretrained(ckpt))  # the old checkpoint, whole
    assert leftovers(ckpt) == []  # the load cleared them
    assert sorted(os.listdir(ckpt)) == ["config.json", "model.safetensors"]
    assert snapshot(ckpt.parent, skip=ckpt) == outside


def test_a_save_killed_after_its_commit_is_finished_by_the_next_load(ckpt):
    proc = saver("kill-applying", ckpt, 3)
    proc.wait(timeout=120)
    assert proc.returncode == -signal.SIGKILL, proc.stderr.read()
    assert ".zoo-save-journal.json" in leftovers(ckpt)
    assert same_weights(tiny(3), zoo.from_pretrained(ckpt))  # the new checkpoint, whole
    assert leftovers(ckpt) == []
    assert "model.safetensors" not in os.listdir(ckpt)  # the old single file, replaced by shards
    # A save finishes an interrupted one too.
    proc = saver("kill-applying", ckpt, 4, shard="2GB")
    proc.wait(timeout=120)
    zoo.save_pretrained(tiny(5), ckpt, model_type="llama")
    assert same_weights(tiny(5), zoo.from_pretrained(ckpt)) and leftovers(ckpt) == []
    assert sorted(os.listdir(ckpt)) == ["config.json", "model.safetensors"]


def test_a_save_failing_after_its_commit_is_finished_not_undone(ckpt, monkeypatch):
    import zoo.checkpoints.files.io as io

    real, calls = io.fsync_dir, []

    def fsync_dir(path):
        calls.append(path)
        if len(calls) == 2:  # the first fsync of the directory after the commit
            raise OSError("I/O error")
        real(path)

    monkeypatch.setattr(io, "fsync_dir", fsync_dir)
    with pytest.raises(OSError, match="I/O error"):
        zoo.save_pretrained(tiny(9), ckpt, model_type="llama", max_shard_size=SHARDED)
    monkeypatch.undo()
    assert same_weights(tiny(9), zoo.from_pretrained(ckpt)) and leftovers(ckpt) == []


def test_the_loser_of_two_concurrent_saves_gets_a_clear_error_and_orphans_nothing(ckpt, tmp_path):
    release = tmp_path / "release"
    proc = saver("hold", ckpt, 6, release)
    try:
        deadline = time.monotonic() + 120
        while not Path(str(release) + ".started").exists():
            assert proc.poll() is None and time.monotonic() < deadline, "the first save did not start"
            time.sleep(0.05)
        during = snapshot(ckpt)
        with pytest.raises(CheckpointError, match=f"{ckpt}: another process is saving"):
            zoo.save_pretrained(tiny(7), ckpt, model_type="llama")
        assert snapshot(ckpt) == during
    finally:
        release.touch()
        proc.wait(timeout=120)
    assert proc.returncode == 0, proc.stderr.read()
    assert same_weights(tiny(6), zoo.from_pretrained(ckpt)) and leftovers(ckpt) == []


def test_a_save_waits_for_a_load_in_progress(ckpt):
    import fcntl
    import threading

    fd = os.open(ckpt, os.O_RDONLY)
    fcntl.flock(fd, fcntl.LOCK_SH)  # what a load holds while it reads
    before, untouched = (ckpt / "model.safetensors").read_bytes(), []

    def load_done():
        untouched.append((ckpt / "model.safetensors").read_bytes() == before)
        os.close(fd)

    threading.Timer(0.2, load_done).start()
    zoo.save_pretrained(tiny(8), ckpt, model_type="llama")
    assert untouched == [True]  # nothing was replaced while the load held the directory
    assert same_weights(tiny(8), zoo.from_pretrained(ckpt))


def test_a_directory_in_the_way_of_a_checkpoint_file_is_not_replaced(ckpt):
    (ckpt / "model.safetensors").unlink()
    (ckpt / "model.safetensors").mkdir()
    (ckpt / "model.safetensors" / "keep").write_text("mine")
    before = snapshot(ckpt)
    with pytest.raises(CheckpointError, match="model.safetensors is in the way"):
        zoo.save_pretrained(tiny(), ckpt, model_type="llama")
    assert snapshot(ckpt) == before


# -- loading bad directories --------------------------------------------------------------------


def sharded(tmp_path, name="sharded"):
    d = tmp_path / name
    zoo.save_pretrained(tiny(), d, model_type="llama", max_shard_size=SHARDED)
    index = json.loads((d / "model.safetensors.index.json").read_text())
    return d, index


def write_index(d, index):
    (d / "model.safetensors.index.json").write_text(json.dumps(index))


@pytest.mark.parametrize("where", ["../outside.safetensors", "/abs/outside.safetensors", "sub/../../x.safetensors"])
def test_a_shard_path_may_not_leave_the_directory(tmp_path, where):
    d, index = sharded(tmp_path)
    name = next(iter(index["weight_map"]))
    first = index["weight_map"][name]
    (tmp_path / "outside.safetensors").write_bytes((d / first).read_bytes())
    index["weight_map"] = {n: (where if f == first else f) for n, f in index["weight_map"].items()}
    write_index(d, index)
    outside = snapshot(tmp_path, skip=d)
    with pytest.raises(CheckpointError, match=f"names shard '{where}', a path that leaves"):
        zoo.from_pretrained(d)
    assert snapshot(tmp_path, skip=d) == outside


def test_hub_cache_symlinks_are_followed(tmp_path):
    d, _ = sharded(tmp_path)
    blobs = tmp_path / "cache" / "blobs"
    snap = tmp_path / "cache" / "snapshots" / "abc"
    blobs.mkdir(parents=True)
    snap.mkdir(parents=True)
    for i, p in enumerate(sorted(d.iterdir())):
        (blobs / f"blob{i}").write_bytes(p.read_bytes())
        (snap / p.name).symlink_to(Path("../../blobs") / f"blob{i}")
    assert same_weights(tiny(), zoo.from_pretrained(snap))


def test_a_tensor_in_two_shards_or_outside_the_index_is_refused(tmp_path):
    d, index = sharded(tmp_path)
    name = "model.layers.1.mlp.down_proj.weight"
    home = index["weight_map"][name]
    other = next(f for f in sorted(set(index["weight_map"].values())) if f != home)
    tensors = load_file(d / other)
    tensors[name] = torch.full_like(load_file(d / home)[name], 7.0)  # a second, different copy
    save_file(tensors, d / other)
    with pytest.raises(CheckpointError, match=f"{other}: holds tensor '{name}', which .* says is in {home}"):
        zoo.from_pretrained(d)
    index["weight_map"].pop(name)
    tensors = load_file(d / home)
    tensors.pop(name)
    save_file(tensors, d / home)
    write_index(d, index)
    with pytest.raises(CheckpointError, match=f"{other}: holds tensor '{name}', which .* does not list"):
        zoo.from_pretrained(d)


@pytest.mark.parametrize("weight_map", [["a"], "model.safetensors", None, {"model.norm.weight": 3}])
def test_an_index_with_a_wrong_weight_map_is_refused(tmp_path, weight_map):
    d, index = sharded(tmp_path)
    write_index(d, {**index, "weight_map": weight_map})
    with pytest.raises(CheckpointError, match="model.safetensors.index.json"):
        zoo.from_pretrained(d)


def header_of(path):
    data = path.read_bytes()
    n = int.from_bytes(data[:8], "little")
    return json.loads(data[8:8 + n]), data[8 + n:]


def with_header(path, header, body):
    raw = json.dumps(header).encode()
    path.write_bytes(len(raw).to_bytes(8, "little") + raw + body)


def test_malformed_and_huge_headers_name_the_file(ckpt):
    path = ckpt / "model.safetensors"
    header, body = header_of(path)
    del header["model.norm.weight"]["data_offsets"]
    with_header(path, header, body)
    with pytest.raises(CheckpointError, match=f"{path}: corrupt safetensors header.*data_offsets"):
        zoo.from_pretrained(ckpt)
    path.write_bytes((2 ** 62).to_bytes(8, "little") + b"{}")
    with pytest.raises(CheckpointError, match=f"{path}: corrupt safetensors header.*too large"):
        zoo.from_pretrained(ckpt)


def test_integer_or_boolean_weights_are_refused_by_name(ckpt):
    tensors = load_file(ckpt / "model.safetensors")
    for bad in (torch.ones(32, dtype=torch.int32), torch.ones(32, dtype=torch.bool)):
        save_file({**tensors, "model.norm.weight": bad}, ckpt / "model.safetensors")
        with pytest.raises(CheckpointError, match=r"tensor 'model\.norm\.weight' is torch\.(int32|bool), where .*floating"):
            zoo.from_pretrained(ckpt)


def test_one_half_precision_tensor_in_a_float32_file_is_refused_unless_converting(ckpt):
    tensors = load_file(ckpt / "model.safetensors")
    tensors["model.layers.1.self_attn.o_proj.weight"] = tensors["model.layers.1.self_attn.o_proj.weight"].half()
    save_file(tensors, ckpt / "model.safetensors")
    with pytest.raises(CheckpointError, match=r"'model\.layers\.1\.self_attn\.o_proj\.weight' is torch\.float16.*dtype="):
        zoo.from_pretrained(ckpt)
    model = zoo.from_pretrained(ckpt, dtype=torch.float32)
    assert {p.dtype for p in model.parameters()} == {torch.float32}


def alarm(seconds):
    """Fail, rather than hang the suite, if a read blocks."""
    def raise_(*_):
        raise TimeoutError("the loader blocked")

    signal.signal(signal.SIGALRM, raise_)
    signal.alarm(seconds)


@pytest.mark.parametrize("name", ["model.safetensors", "config.json", "shard"])
def test_a_fifo_named_like_a_checkpoint_file_is_refused_not_read(tmp_path, name):
    d, index = sharded(tmp_path)
    if name == "shard":
        name = sorted(set(index["weight_map"].values()))[1]
    elif name == "model.safetensors":
        (d / "model.safetensors.index.json").unlink()
    (d / name).unlink(missing_ok=True)
    os.mkfifo(d / name)
    alarm(60)
    try:
        with pytest.raises(CheckpointError, match=f"{d / name}: the .* is a FIFO, not a regular file"):
            zoo.from_pretrained(d)
    finally:
        signal.alarm(0)


def test_a_config_is_checked_against_the_weights_before_anything_is_built(ckpt, monkeypatch):
    config = json.loads((ckpt / "config.json").read_text())
    (ckpt / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 4000}))

    def build_model(*a, **k):
        raise AssertionError("built before the config was checked against the weights")

    monkeypatch.setattr("zoo.checkpoints.build_model", build_model)
    with pytest.raises(CheckpointError, match="config.json describes 4000 layers, but the weights hold layers 0..1"):
        zoo.from_pretrained(ckpt)
    # Beyond any model zoo describes, the field's own bound refuses it when it is read, naming it.
    (ckpt / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 20000}))
    with pytest.raises(ConfigError, match="field 'num_hidden_layers' .*: 20000 is beyond zoo's limit of 4,096"):
        zoo.from_pretrained(ckpt)


# -- verify -------------------------------------------------------------------------------------


def test_verify_refuses_pickles_before_any_reference_runs(tmp_path, monkeypatch):
    def run_reference(*a, **k):
        raise AssertionError("the reference read the directory")

    monkeypatch.setattr(importlib.import_module("zoo.tools.verification"), "run_reference", run_reference)
    d = tmp_path / "pickled"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(TINY))
    (d / "pytorch_model.bin").write_bytes(b"\x80\x04not really a pickle")
    with pytest.raises(CheckpointError, match="pytorch_model.bin.*never unpickles"):
        zoo.verify(d)
    s, index = sharded(tmp_path)
    index["weight_map"] = {n: "pytorch_model-00001-of-00002.bin" for n in index["weight_map"]}
    write_index(s, index)
    with pytest.raises(CheckpointError, match="'pytorch_model-00001-of-00002.bin', which is not a safetensors file"):
        zoo.verify(s)


def test_verify_reports_nonfinite_weights_where_they_are(ckpt):
    pytest.importorskip("transformers")
    tensors = load_file(ckpt / "model.safetensors")
    w = tensors["model.layers.1.mlp.up_proj.weight"]
    w[3, 5] = float("nan")
    w[4, 0] = float("inf")
    save_file(tensors, ckpt / "model.safetensors")
    report = zoo.verify(ckpt, seq_len=8, batch_size=1)
    assert report.nonfinite == ["layers.1.ffn.up.weight: 1 NaN, 1 Inf (first at (3, 5))"]
    assert not report.passed and report.worst_layer == 2  # after layer 1 (0 is the embeddings)
    assert "non-finite weights: layers.1.ffn.up.weight" in report.summary()

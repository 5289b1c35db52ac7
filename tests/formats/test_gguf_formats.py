"""GGUF in and out for every architecture zoo maps, on tiny random checkpoints made by transformers:
zoo writes the file, zoo and transformers' GGUF loader read it back; and each kind of bad file is
an error naming the file and the key or tensor."""

import numpy as np
import pytest
import torch

import zoo
from zoo.checkpoints import CheckpointError
from zoo.checkpoints.tiny import make_tiny

gguf = pytest.importorskip("gguf")
transformers = pytest.importorskip("transformers")

DEFAULT_ROPE = {"rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}}
# Each tiny config, changed where llama.cpp's architecture has no key for what the tiny one reaches
# (a sliding window in llama, dense layers in qwen2moe); those are the refusals tested below.
CASES = {
    "llama": DEFAULT_ROPE,
    "mistral": {**DEFAULT_ROPE, "sliding_window": None},
    "qwen2": {**DEFAULT_ROPE, "use_sliding_window": False, "head_dim": 16},
    "qwen3": {"use_sliding_window": False},
    "qwen2_moe": {**DEFAULT_ROPE, "mlp_only_layers": []},
    "qwen3_moe": {**DEFAULT_ROPE, "decoder_sparse_step": 1},
    "gemma2": {"query_pre_attn_scalar": 24},
    "gemma3_text": {"num_hidden_layers": 6, "layer_types": None, "query_pre_attn_scalar": 24},
    "olmo2": DEFAULT_ROPE,
    "falcon": {},
    "gpt2": {},
    "phi": {"qk_layernorm": False},  # the zoo-phi plugin's format declares its GGUF architecture (phi2)
}
# Where transformers' GGUF loader reads every field these tiny configs set (it reads no head_dim for
# qwen3, no expert widths, no GPT-2 vocabulary size, ...), its weights are compared too.
TRANSFORMERS_READS = ("llama", "qwen2", "gemma2", "gemma3_text")


def gemma_rounding(name, t, model_type):
    """llama.cpp stores Gemma's norms as 1 + w: w comes back as (1 + w) - 1 in float32."""
    return (t + 1) - 1 if model_type.startswith("gemma") and name.endswith("norm.weight") else t


def architecture(spec):
    """The spec without the loss weights (training settings, which GGUF has no key for)."""
    def strip(x):
        if isinstance(x, dict):
            return {k: strip(v) for k, v in x.items() if not k.endswith("loss")}
        return [strip(v) for v in x] if isinstance(x, list) else x

    return strip(spec.to_dict())


@pytest.fixture(params=list(CASES))
def written(request, tmp_path):
    model_type = request.param
    hf = make_tiny(model_type, tmp_path, overrides=CASES[model_type])
    ours = zoo.from_pretrained(tmp_path, progress=False)
    return model_type, hf, ours, zoo.save_gguf(ours, tmp_path / "tiny.gguf", dtype="f32")


def test_a_written_file_reads_back_into_the_same_model(written):
    model_type, hf, ours, path = written
    back = zoo.from_pretrained(path, progress=False)
    assert architecture(back.spec) == architecture(ours.spec)
    for name, t in ours.state_dict().items():
        assert torch.equal(back.state_dict()[name], gemma_rounding(name, t, model_type)), name
    if model_type in TRANSFORMERS_READS:
        theirs = transformers.AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                                   dtype=torch.float32).state_dict()
        for name, t in hf.state_dict().items():
            if name in theirs:
                assert torch.equal(theirs[name], gemma_rounding(name, t, model_type)), name


def test_llama_logits_through_gguf_equal_transformers(tmp_path):
    hf = make_tiny("llama", tmp_path, overrides=DEFAULT_ROPE)
    path = zoo.save_gguf(zoo.from_pretrained(tmp_path, progress=False), tmp_path / "tiny.gguf", dtype="f32")
    theirs = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file=path.name, dtype=torch.float32,
                                                               attn_implementation="eager")
    ids = torch.randint(0, 128, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref, via_gguf, ours = hf(ids).logits, theirs(ids).logits, zoo.from_pretrained(path, progress=False)(ids)
        own = float((hf.double()(ids).logits - ref.double()).abs().max())  # transformers' float32 error
    assert torch.equal(via_gguf, ref)  # transformers reads zoo's file into the very same weights
    assert float((ours.double() - ref.double()).abs().max()) <= 4 * own + 1e-6


def test_q8_0_is_within_its_block_error(tmp_path):
    make_tiny("llama", tmp_path, overrides=DEFAULT_ROPE)
    ours = zoo.from_pretrained(tmp_path, progress=False)
    back = zoo.from_pretrained(zoo.save_gguf(ours, tmp_path / "q8.gguf", dtype="q8_0"), progress=False)
    for name, t in ours.state_dict().items():
        got = back.state_dict()[name]
        if t.dim() < 2:
            assert torch.equal(got, t), name  # vectors stay F32
            continue
        # Q8_0: blocks of 32 along a row, q = round(x / d) with d = max|x| / 127 stored as F16, so
        # |error| <= d / 2 + 127 d 2^-11 (the scale's own rounding).
        blocks = t.reshape(-1, 32)
        d = blocks.abs().amax(1, keepdim=True) / 127
        err = (got.reshape(-1, 32) - blocks).abs()
        assert bool((err <= d * (0.5 + 127 * 2 ** -11) + 1e-12).all()), name
        assert not torch.equal(got, t)


# -- refusals and bad files ----------------------------------------------------------------------

def tiny_file(tmp_path, name="tiny.gguf"):
    make_tiny("llama", tmp_path / "hf", overrides=DEFAULT_ROPE)
    return zoo.save_gguf(zoo.from_pretrained(tmp_path / "hf", progress=False), tmp_path / name, dtype="f32")


def rewrite(src, dst, *, arch=None, keys=None, tensors=None):
    """A copy of the GGUF file ``src`` with metadata ``keys`` set and ``tensors`` replaced."""
    reader = gguf.GGUFReader(src)
    writer = gguf.GGUFWriter(dst, arch or reader.fields["general.architecture"].contents())
    for key, f in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture" or key in (keys or {}):
            continue
        if f.types[0] == gguf.GGUFValueType.ARRAY:
            writer.add_array(key, f.contents())
        else:
            writer.add_key_value(key, f.contents(), f.types[0])
    for key, (value, kind) in (keys or {}).items():
        writer.add_key_value(key, value, kind)
    for t in reader.tensors:
        writer.add_tensor(t.name, np.array((tensors or {}).get(t.name, t.data)))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return dst


def test_a_truncated_file_is_refused_by_name(tmp_path):
    path = tiny_file(tmp_path)
    data = path.read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[: len(data) - 1000])
    with pytest.raises(CheckpointError, match=r"cut\.gguf.*(cut short|not a readable)"):
        zoo.from_pretrained(cut)


def test_an_unknown_architecture_is_refused_by_name(tmp_path):
    path = rewrite(tiny_file(tmp_path), tmp_path / "odd.gguf", arch="rwkv6")
    with pytest.raises(CheckpointError, match=r"odd\.gguf.*'rwkv6'.*llama"):
        zoo.from_pretrained(path)


def test_a_tensor_whose_shape_disagrees_with_the_metadata_is_refused_by_name(tmp_path):
    U32 = gguf.GGUFValueType.UINT32
    path = rewrite(tiny_file(tmp_path), tmp_path / "wide.gguf", keys={"llama.feed_forward_length": (128, U32)})
    with pytest.raises(CheckpointError, match=r"wide\.gguf: tensor 'blk\.0\.ffn_(gate|up|down)\.weight' has shape"):
        zoo.from_pretrained(path)


def test_a_tensor_type_gguf_cannot_dequantise_is_refused_by_name(tmp_path):
    src = tiny_file(tmp_path)
    norm = gguf.GGUFReader(src).tensors[1]
    path = rewrite(src, tmp_path / "int.gguf", tensors={norm.name: np.zeros(norm.data.shape, np.int8)})
    with pytest.raises(CheckpointError, match=rf"int\.gguf: tensor '{norm.name}' is stored as I8"):
        zoo.from_pretrained(path)


def test_a_metadata_key_zoo_cannot_read_is_refused_by_name(tmp_path):
    F32 = gguf.GGUFValueType.FLOAT32
    path = rewrite(tiny_file(tmp_path), tmp_path / "clamp.gguf", keys={"llama.attention.clamp_kqv": (8.0, F32)})
    with pytest.raises(CheckpointError, match=r"clamp\.gguf: metadata key 'llama\.attention\.clamp_kqv'"):
        zoo.from_pretrained(path)


def test_a_file_without_a_tokenizer_says_so(tmp_path):
    from zoo.inference.tokenizer import Tokenizer

    path = tiny_file(tmp_path)  # written from safetensors: no GGUF tokenizer to embed
    with pytest.raises(CheckpointError, match=r"tiny\.gguf: holds no tokenizer \(metadata key 'tokenizer\.ggml\.model'"):
        Tokenizer(path)


def test_what_llama_cpp_cannot_represent_is_refused_by_name(tmp_path):
    make_tiny("mistral", tmp_path / "window")  # a sliding window: llama.cpp's llama has none
    with pytest.raises(CheckpointError, match=r"window"):
        zoo.save_gguf(zoo.from_pretrained(tmp_path / "window", progress=False), tmp_path / "w.gguf")
    make_tiny("mamba2", tmp_path / "ssm")  # a recurrent mixer zoo writes no GGUF architecture for
    with pytest.raises(CheckpointError, match=r"no architecture zoo writes mamba2"):
        zoo.save_gguf(zoo.from_pretrained(tmp_path / "ssm", progress=False), tmp_path / "m.gguf")
    assert not list(tmp_path.glob("*.gguf")) and not list(tmp_path.glob(".*.tmp"))  # nothing half-written


def test_the_command_line_exports_describes_and_verifies_a_gguf_file(tmp_path, capsys):
    from zoo.cli import main

    make_tiny("llama", tmp_path / "hf", overrides=DEFAULT_ROPE)
    out = tmp_path / "tiny.gguf"
    assert main(["export", str(tmp_path / "hf"), str(out), "--gguf", "--dtype", "f32"]) == 0
    assert main(["describe", str(out)]) == 0
    described = capsys.readouterr().out
    assert "layers         2" in described and "d_model        64" in described
    assert main(["verify", str(out), "--seq-len", "8", "--batch-size", "1"]) == 0
    report = capsys.readouterr().out
    assert "vs transformers" in report and "PASS" in report
    assert "relative to the reference's max |h|" in report and "pass rule: max |Δlogits| <= 1e-03" in report


# -- metadata of the wrong type or out of range: an error naming the key ----------------------------

@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    return tiny_file(tmp_path_factory.mktemp("tiny"))


def tokenizer_keys():
    """The tokenizer metadata of a GGUF file: key -> (value, type); a byte-ish vocabulary of 300 tokens."""
    T = gguf.GGUFValueType
    tokens = [chr(0x100 + i) for i in range(300)]
    return {"tokenizer.ggml.model": ("gpt2", T.STRING), "tokenizer.ggml.tokens": (tokens, T.ARRAY),
            "tokenizer.ggml.token_type": ([1] * 300, T.ARRAY), "tokenizer.ggml.merges": ([], T.ARRAY),
            "tokenizer.ggml.bos_token_id": (0, T.UINT32), "tokenizer.ggml.eos_token_id": (1, T.UINT32),
            "tokenizer.chat_template": ("{{ messages[0].content }}", T.STRING)}


A, S, U32, F32 = (gguf.GGUFValueType.ARRAY, gguf.GGUFValueType.STRING, gguf.GGUFValueType.UINT32,
                  gguf.GGUFValueType.FLOAT32)


@pytest.mark.parametrize("keys, match", [
    ({"llama.rope.freq_base": ("fast", S)}, r"'llama\.rope\.freq_base' must be a number, but it holds STRING"),
    ({"llama.attention.layer_norm_rms_epsilon": ("tiny", S)}, r"'llama\.attention\.layer_norm_rms_epsilon' must be a number"),
    ({"llama.rope.dimension_count": ("16", S)}, r"'llama\.rope\.dimension_count' must be an integer, but it holds STRING"),
    ({"llama.attention.head_count": (0, U32)}, r"'llama\.attention\.head_count' = 0 must be a positive integer"),
    ({"llama.attention.head_count": (4.5, F32)}, r"'llama\.attention\.head_count' = 4\.5 must be a positive integer"),
    ({"llama.attention.causal": (1, U32)}, r"'llama\.attention\.causal' must be a boolean"),
    ({"tokenizer.ggml.eos_token_id": (10 ** 6, U32)}, r"'tokenizer\.ggml\.eos_token_id' = 1000000 is outside the vocabulary"),
])
def test_metadata_of_the_wrong_type_is_refused_naming_the_key(tiny_gguf, tmp_path, keys, match):
    from zoo.checkpoints.files.gguf import GGUFFile

    path = rewrite(tiny_gguf, tmp_path / "odd.gguf", keys=keys)
    with pytest.raises(CheckpointError, match=r"odd\.gguf: metadata key " + match):
        GGUFFile(path).config()


def test_an_architecture_that_is_not_a_string_is_refused_naming_the_key(tiny_gguf, tmp_path):
    data = tiny_gguf.read_bytes()
    key = b"general.architecture"
    at = data.find(key) + len(key)
    assert int.from_bytes(data[at:at + 4], "little") == 8  # STRING: rewritten as an array of one string
    odd = data[:at] + (9).to_bytes(4, "little") + (8).to_bytes(4, "little") + (1).to_bytes(8, "little") + data[at + 4:]
    (tmp_path / "arch.gguf").write_bytes(odd)
    with pytest.raises(CheckpointError, match=r"arch\.gguf: metadata key 'general\.architecture' must be a string, "
                                              r"but it holds ARRAY of STRING"):
        zoo.from_pretrained(tmp_path / "arch.gguf")


@pytest.mark.parametrize("change, match", [
    ("ints", r"'tokenizer\.ggml\.tokens' must be an array of strings, but it holds ARRAY of INT32"),
    ("short_types", r"'tokenizer\.ggml\.token_type' has 10 entries for \d+ tokens"),
    ("bos", r"'tokenizer\.ggml\.bos_token_id' = 99999999 is outside the vocabulary"),
    ("template", r"'tokenizer\.chat_template' must be a string, but it holds INT32"),
])
def test_a_broken_gguf_tokenizer_is_refused_naming_the_key(tmp_path, change, match):
    """A tokenizer's keys, one of them broken, in a file with no tensors (each is checked before the
    tokenizer is built)."""
    from zoo.inference.tokenizer import Tokenizer

    writer = gguf.GGUFWriter(tmp_path / "tok.gguf", "llama")
    for key, (value, kind) in tokenizer_keys().items():
        if change == "ints" and key == "tokenizer.ggml.tokens":
            value = list(range(len(value)))
        if change == "short_types" and key == "tokenizer.ggml.token_type":
            value = value[:10]
        if change == "bos" and key == "tokenizer.ggml.bos_token_id":
            value = 99999999
        if change == "template" and key == "tokenizer.chat_template":
            value, kind = 7, gguf.GGUFValueType.INT32
        (writer.add_array(key, value) if kind == A else writer.add_key_value(key, value, kind))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(CheckpointError, match=r"tok\.gguf: metadata key " + match):
        Tokenizer(tmp_path / "tok.gguf")

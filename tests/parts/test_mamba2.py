"""Mamba-2 (SSD): the mixer's two forms agree, its decode state is of fixed size, and tiny random
checkpoints written by transformers (``mamba2``) and in mamba_ssm's own layout load and compute what
transformers' torch path computes: logits, greedy tokens, and the cache contents."""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

import zoo
import zoo.tools.accounting
import zoo.testing as zt
from zoo.checkpoints import CheckpointError, ConfigError, config_to_spec
from zoo.core.context import ForwardContext
from zoo.core.spec import SpecError
from zoo.core.state import DecodeState

from hf_pairs import assert_several_tokens_continue_the_full_forward

pytestmark = pytest.mark.parity  # compared with transformers in float32: the README's test command runs these at 1 and 2 threads

transformers = pytest.importorskip("transformers")
tiny = pytest.importorskip("zoo.checkpoints.tiny")

# SSD's tolerance: the chunked form takes exp of segment sums of dt * A within a chunk and carries the
# state across chunks, the recurrent form multiplies exp(dt * A) step by step; in float32 the two
# orders of summation differ by a few ulps per step, compounded through the decay, the gated norm
# (which divides by the RMS of small outputs) and the layers.
SSD_ATOL = 1e-4

MIXER = {"n_heads": 4, "head_dim": 8, "state_size": 8, "n_groups": 2, "chunk_size": 4, "bias": True,
         "dt_limit_min": 0.01, "dt_limit_max": 0.5}


def mixer_and_inputs(T, **cfg):
    spec = zt.tiny_spec_with("mixer", "mamba2", {**MIXER, **cfg})
    torch.manual_seed(0)
    mixer = spec.layer(0).mixer.build(d_model=spec.d_model, layer=spec.layer(0), spec=spec, index=0)
    with torch.no_grad():  # away from the initial values: D, the norm's weight, the biases
        for p in mixer.parameters():
            p.add_(0.2 * torch.randn_like(p))
    x = torch.randn(2, T, spec.d_model, generator=torch.Generator().manual_seed(1))
    return mixer, x


def run(mixer, x, state=None, start=0):
    T = x.shape[1]
    ctx = ForwardContext(position_ids=torch.arange(start, start + T).expand(x.shape[0], T),
                         slots=torch.arange(start, start + T), state=state)
    return mixer(x, ctx, None)


@pytest.mark.parametrize("T", [1, 5, 13, 27])
@torch.no_grad()
def test_parallel_form_equals_the_recurrent_form_on_odd_lengths(T):
    mixer, x = mixer_and_inputs(T)
    parallel = run(mixer, x)  # chunks of 4: a ragged last chunk for every odd T
    state = DecodeState([mixer.new_state(2, None, dtype=torch.float32, device="cpu")], batch=2)
    steps = [run(mixer, x[:, t : t + 1], state, t) for t in range(T)]  # one step per token
    torch.testing.assert_close(torch.cat(steps, 1), parallel, atol=1e-5, rtol=1e-5)
    for chunk in (1, 3, 64):  # the chunk size changes nothing but the order of summation
        mixer.cfg = type(mixer.cfg)(**{**mixer.cfg.__dict__, "chunk_size": chunk})
        torch.testing.assert_close(run(mixer, x), parallel, atol=1e-5, rtol=1e-5)


@torch.no_grad()
def test_a_prefilled_state_continues_as_the_whole_sequence():
    mixer, x = mixer_and_inputs(17)
    state = DecodeState([mixer.new_state(2, None, dtype=torch.float32, device="cpu")], batch=2)
    parts = [run(mixer, x[:, a:b], state, a) for a, b in ((0, 6), (6, 7), (7, 17))]
    torch.testing.assert_close(torch.cat(parts, 1), run(mixer, x), atol=1e-5, rtol=1e-5)


def test_decoding_conformance_and_the_state_is_fixed_size():
    spec = zt.tiny_spec_with("mixer", "mamba2", MIXER, **{"layers.default.block": "mixer_only"})
    model = zt.tiny_model(spec)
    ids = torch.randint(0, 64, (2, 14), generator=torch.Generator().manual_seed(0))
    zt.check_decoding(model, ids)
    sizes = []
    with torch.no_grad():
        state = model.new_state(2, None)
        for chunk in (ids[:, :3], ids, ids[:, :1]):
            model(chunk, state=state)
            sizes.append(state.nbytes())
    mixer = model.layers[0].mixer
    conv, ssm = mixer.conv_dim * 4, 4 * 8 * 8
    assert sizes == [2 * 2 * 4 * (conv + ssm)] * 3  # 2 layers x batch 2 x float32, whatever the length
    assert mixer.cost(10) == mixer.cost(10_000)
    assert mixer.cost(10).state_fixed == conv + ssm and mixer.cost(10).state_per_token == 0
    figures = zoo.tools.accounting.account(model, context=14, batch=2, dtype="fp32")["decode_state"]
    assert figures["bytes"] == figures["fixed_bytes"] == sizes[0] and figures["bytes_per_token"] == 0


@torch.no_grad()
def test_decode_memory_is_flat_on_a_hybrid_and_grows_with_attention_alone():
    """Decode state after 1k and after 16k tokens (fed 1k at a time, then one decoded token): a tiny
    Mamba-2 / attention hybrid whose attention slides over 256 tokens holds the same bytes, an
    attention-only model 16 times more. (Full attention grows with the context in any model; the
    hybrid's Mamba-2 layer holds the same state either way.)"""
    mamba = {"mixer": {"name": "mamba2", **MIXER, "chunk_size": 64}, "ffn": {"name": "glu"}}
    attention = {"mixer": {"name": "attention", "n_heads": 4, "n_kv_heads": 2, "window": 256}, "ffn": {"name": "glu"}}
    hybrid = zt.tiny_model({"layers": {"mamba": mamba, "attention": attention},
                            "layer_pattern": ["mamba", "attention"]})
    dense = zt.tiny_model({"n_layers": 1})

    def held(model):  # state bytes after 1k and after 16k tokens, each followed by one decoded token
        state, out = model.new_state(1, None), []
        ids = torch.randint(0, 64, (1, 1024), generator=torch.Generator().manual_seed(0))
        for n in range(1, 17):
            model(ids, state=state)
            if n in (1, 16):
                model(ids[:, :1], state=state)
                out.append((state.nbytes(), [s.nbytes() for s in state.layers]))
        return out

    (h1, layers1), (h16, layers16) = held(hybrid)
    (d1, _), (d16, _) = held(dense)
    assert h16 == h1 and layers16[0] == layers1[0] > 0
    assert d16 >= 15 * d1  # keys and values of every token (a buffer grown by doubling)


# ------------------------------------------------------------------------------ checkpoints

@pytest.fixture(scope="module")
def pair(hf_pair):
    """A tiny random transformers Mamba2ForCausalLM (biases, and a dt limit that prefill reaches),
    saved and loaded by zoo."""
    return hf_pair("mamba2", use_bias=True, time_step_limit=[0.0, 0.5])


def ids_of(B, T, seed=0):
    return torch.randint(0, 128, (B, T), generator=torch.Generator().manual_seed(seed))


@torch.no_grad()
def test_logits_equal_transformers_torch_path(pair):
    hf, ours, _ = pair
    ids = ids_of(2, 37)  # four chunks of 8 and a ragged one
    ref = hf(ids).logits
    assert ref.abs().max() > 1.0
    torch.testing.assert_close(ours(ids), ref, atol=SSD_ATOL, rtol=0)


@torch.no_grad()
def test_greedy_tokens_and_decode_states_equal_transformers(tmp_path):
    # No dt limit here: transformers' one-token step ignores time_step_limit (zoo applies it in both
    # forms, so that they agree); with the default limit (0, inf) the two agree.
    hf = tiny.make_tiny("mamba2", tmp_path, overrides={"use_bias": True})
    ours = zoo.from_pretrained(tmp_path)
    ids = ids_of(1, 11)
    expected = hf.generate(ids, max_new_tokens=12, min_new_tokens=12, do_sample=False, num_beams=1,
                           pad_token_id=0, eos_token_id=None)
    assert torch.equal(zoo.generate(ours, ids, 12), expected)

    # The cache after a prefill of 9 and 4 single tokens: conv windows and SSM states.
    ids = ids_of(2, 13, seed=2)
    cache = hf(ids[:, :9], use_cache=True).cache_params
    state = ours.new_state(2)
    ours(ids[:, :9], state=state)
    for t in range(9, 13):
        cache = hf(ids[:, t : t + 1], cache_params=cache, use_cache=True).cache_params
        ours(ids[:, t : t + 1], state=state)
    for i in range(ours.spec.n_layers):
        ref = cache.layers[i]
        torch.testing.assert_close(state.layers[i].conv, ref.conv_states[0], atol=1e-5, rtol=0)
        # zoo keeps the SSM state (B, H, N, P): keys by values, as the shared core does
        torch.testing.assert_close(state.layers[i].ssm.transpose(-1, -2), ref.recurrent_states[0], atol=1e-5, rtol=0)


@torch.no_grad()
def test_several_new_tokens_onto_an_existing_state(pair):
    """transformers' mamba2 continues a cache with several tokens correctly (its convolution reads the
    cached window, its chunked scan starts from the cached state): both equal the full forward."""
    hf, ours, _ = pair
    assert_several_tokens_continue_the_full_forward(hf, ours, cache="cache_params", atol=SSD_ATOL)


@torch.no_grad()
def test_mamba_ssm_layout_loads_with_its_own_names_and_padded_vocabulary(pair, tmp_path):
    hf, _, d = pair
    cfg = hf.config
    layout = {"d_model": cfg.hidden_size, "d_intermediate": 0, "n_layer": cfg.num_hidden_layers, "vocab_size": 121,
              "ssm_cfg": {"layer": "Mamba2", "d_state": cfg.state_size, "headdim": cfg.head_dim, "ngroups": cfg.n_groups,
                          "chunk_size": cfg.chunk_size, "bias": True, "dt_limit": [0.0, 0.5]},
              "attn_layer_idx": [], "attn_cfg": {}, "rms_norm": True, "residual_in_fp32": True,
              "fused_add_norm": True, "pad_vocab_size_multiple": 16, "tie_embeddings": False}
    tensors = {k.replace("backbone.embeddings.", "backbone.embedding."): v for k, v in load_file(d / "model.safetensors").items()}
    assert "backbone.embedding.weight" in tensors
    save_file(tensors, tmp_path / "model.safetensors")
    (tmp_path / "config.json").write_text(json.dumps(layout))
    ours = zoo.from_pretrained(tmp_path)
    assert ours.spec.vocab_size == 128  # 121 padded to a multiple of 16, as mamba_ssm builds it
    ids = ids_of(1, 20)
    torch.testing.assert_close(ours(ids), hf(ids).logits, atol=SSD_ATOL, rtol=0)


# ------------------------------------------------------------------------------ bad input

def test_bad_settings_name_their_field():
    with pytest.raises(SpecError, match=r"layers\.default\.mixer\.chunk_size.*positive integer"):
        zt.tiny_spec_with("mixer", "mamba2", {**MIXER, "chunk_size": 0})
    with pytest.raises(SpecError, match=r"layers\.default\.mixer\.n_groups.*not divisible"):
        zt.tiny_spec_with("mixer", "mamba2", {**MIXER, "n_groups": 3})
    config = {**tiny.tiny_config("mamba2"), "model_type": "mamba2"}
    with pytest.raises(ConfigError, match="'chunk_size'"):
        config_to_spec({**config, "chunk_size": 0})
    with pytest.raises(ConfigError, match="'num_heads'.*expand"):
        config_to_spec({**config, "num_heads": 6})
    with pytest.raises(ConfigError, match=r"'ssm_cfg\.norm_before_gate'"):
        config_to_spec({"d_model": 32, "n_layer": 2, "vocab_size": 64, "ssm_cfg": {"norm_before_gate": True}})
    with pytest.raises(ConfigError, match="'attn_layer_idx'"):
        config_to_spec({"d_model": 32, "n_layer": 2, "vocab_size": 64, "ssm_cfg": {}, "attn_layer_idx": [1]})


def test_a_state_size_that_disagrees_with_the_checkpoint_is_refused(pair, tmp_path):
    _, _, d = pair
    config = json.loads((d / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "state_size": 8}))
    (tmp_path / "model.safetensors").write_bytes((d / "model.safetensors").read_bytes())
    with pytest.raises(CheckpointError, match=r"in_proj\.weight.*the weights have state_size = 16 .*says 8"):
        zoo.from_pretrained(tmp_path)


def test_a_layer_schedule_naming_an_unregistered_mixer_says_so():
    with pytest.raises(SpecError, match=r"layers\.ssm\.mixer\.name.*mamba3.*mamba2"):
        zt.tiny_model({"layers": {"ssm": {"mixer": {"name": "mamba3", "n_heads": 4}}}, "layer_pattern": ["ssm"]})


def test_verify_lines_up_transformers_hidden_states(tmp_path):
    """transformers' mamba2 lists each layer's output and then the normed last one, without the
    embeddings; zoo verify lines them up, so every layer agrees (not only the logits)."""
    tiny.make_tiny("mamba2", tmp_path)
    report = zoo.verify(tmp_path, seq_len=12)
    assert report.passed and len(report.hidden) == zoo.from_pretrained(tmp_path).spec.n_layers + 1
    assert max(report.hidden) < 1e-4, report.hidden

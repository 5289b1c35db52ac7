"""Gated DeltaNet and the Qwen3-Next family: the two forms agree, the decode contract holds, and a
tiny Qwen3-Next written by transformers computes, decodes and caches what transformers' pure-torch
path does (transformers' own GDN functions are the reference for the forms too)."""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

import zoo
import zoo.testing as zt
from zoo.checkpoints import CheckpointError, ConfigError, config_to_spec
from zoo.checkpoints.tiny import make_tiny, tiny_config
from zoo.components.mixers.gated_deltanet import (
    FLUSH_LOG_DECAY,
    chunk_gated_delta_rule,
    l2norm,
    recurrent_gated_delta_rule,
)
from zoo.core.spec import SpecError

from hf_pairs import assert_within_reference_error, float64_twin

pytestmark = [pytest.mark.parity, pytest.mark.usefixtures("one_thread")]  # compared with transformers in float32: the README's test command runs these at 1 and 2 threads
transformers = pytest.importorskip("transformers")
from transformers.models.qwen3_next import modeling_qwen3_next as hf_next  # noqa: E402


def inputs(B, H, T, Dk, Dv, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = l2norm(torch.randn(B, H, T, Dk, generator=gen)) * Dk ** -0.5
    k = l2norm(torch.randn(B, H, T, Dk, generator=gen))
    v = torch.randn(B, H, T, Dv, generator=gen)
    g = -torch.rand(B, H, T, generator=gen) * 2  # decays down to exp(-2) per step
    beta = torch.rand(B, H, T, generator=gen)
    S0 = torch.randn(B, H, Dk, Dv, generator=gen)
    return q, k, v, g, beta, S0


@pytest.mark.parametrize("T, chunk", [(1, 4), (7, 4), (13, 8), (33, 16), (67, 64), (77, 4)])  # 77/4: blocks of chunks
def test_the_chunked_and_recurrent_forms_agree_on_odd_lengths(T, chunk):
    q, k, v, g, beta, S0 = inputs(2, 3, T, 8, 6, seed=T)
    for state in (None, S0):
        y_c, S_c = chunk_gated_delta_rule(q, k, v, g, beta, state, chunk)
        y_r, S_r = recurrent_gated_delta_rule(q, k, v, g, beta, state)
        torch.testing.assert_close(y_c, y_r, atol=1e-5, rtol=0)
        torch.testing.assert_close(S_c, S_r, atol=1e-5, rtol=0)


def test_decays_flushed_to_zero_in_the_chunked_form_change_nothing():
    """The chunked form takes decay factors below exp(FLUSH_LOG_DECAY) as 0 (their products turn
    subnormal, which the CPU computes slowly). With decays of up to exp(-30) per step most factors
    within each chunk are flushed; the recurrent form, which flushes nothing, still agrees."""
    q, k, v, g, beta, S0 = inputs(2, 3, 45, 8, 6, seed=5)
    g = g * 15
    assert (g[..., :16].sum(-1) < FLUSH_LOG_DECAY).all()  # every chunk of 16 reaches the flushed range
    for state in (None, S0):
        y_c, S_c = chunk_gated_delta_rule(q, k, v, g, beta, state, 16)
        y_r, S_r = recurrent_gated_delta_rule(q, k, v, g, beta, state)
        torch.testing.assert_close(y_c, y_r, atol=1e-5, rtol=0)
        torch.testing.assert_close(S_c, S_r, atol=1e-5, rtol=0)


def test_the_forms_match_transformers_functions():
    """transformers' functions take (B, T, H, D) un-normalised q/k with fewer key heads than value
    heads; zoo's take normalised, scaled (B, H, T, D) heads (the recurrent form one per value head)."""
    gen = torch.Generator().manual_seed(3)
    B, T, Hk, Hv, Dk, Dv = 2, 75, 2, 4, 8, 6
    q, k = torch.randn(B, T, Hk, Dk, generator=gen), torch.randn(B, T, Hk, Dk, generator=gen)
    v = torch.randn(B, T, Hv, Dv, generator=gen)
    g, beta = -torch.rand(B, T, Hv, generator=gen), torch.rand(B, T, Hv, generator=gen)
    S0 = torch.randn(B, Hv, Dk, Dv, generator=gen)
    kw = dict(initial_state=S0, output_final_state=True, use_qk_l2norm_in_kernel=True)
    want_c = hf_next.torch_chunk_gated_delta_rule(q, k, v, g=g, beta=beta, **kw)
    want_r = hf_next.torch_recurrent_gated_delta_rule(q, k, v, g=g, beta=beta, **kw)
    rest = (v.transpose(1, 2), g.transpose(1, 2), beta.transpose(1, 2), S0)
    grouped = (l2norm(q.transpose(1, 2)) * Dk ** -0.5, l2norm(k.transpose(1, 2)))  # the chunked form takes Hk heads
    expanded = [x.repeat_interleave(Hv // Hk, 1) for x in grouped]
    for (y, S), (want_y, want_S) in ((chunk_gated_delta_rule(*grouped, *rest), want_c),
                                     (recurrent_gated_delta_rule(*expanded, *rest), want_r)):
        torch.testing.assert_close(y.transpose(1, 2), want_y, atol=1e-5, rtol=0)
        torch.testing.assert_close(S, want_S, atol=1e-5, rtol=0)


def test_the_mixer_passes_the_mixer_contract():
    """Causality, padding, gradients, dtypes, and decoding (prefill then tokens, several tokens onto
    a state, a left-padded batch, the static state) against the full forward, alone and in a hybrid."""
    zt.check("mixer", "gated_deltanet", {"n_heads": 4, "n_key_heads": 2, "key_dim": 8, "value_dim": 8,
                                         "chunk_size": 4})


def test_the_decode_state_is_fixed_in_size_and_accounted():
    model = zt.tiny_model(zt.hybrid_spec("gated_deltanet", {"n_heads": 4, "n_key_heads": 2, "key_dim": 8,
                                                            "value_dim": 6, "chunk_size": 4}))
    gdn = model.layers[0].mixer
    cost = gdn.cost(4096)
    assert cost.state_fixed == 4 * 8 * 6 + (2 * 2 * 8 + 4 * 6) * 3 and cost.state_per_token == 0
    sizes = []
    for T in (8, 40):
        state = model.new_state(1, None)
        with torch.no_grad():
            model(torch.randint(0, 64, (1, T)), state=state)
        sizes.append(state.layers[0].nbytes())
    assert sizes[0] == sizes[1] == cost.state_fixed * 4  # float32, the same after 8 tokens as after 40


@pytest.mark.parametrize("field, value, message", [
    ("n_key_heads", 3, "not divisible by n_key_heads 3"),
    ("chunk_size", 48, "power of two"),
    ("conv_kernel", 1, "at least 2"),
    ("key_dim", 0, "must be positive"),
])
def test_bad_settings_name_the_field(field, value, message):
    cfg = {"n_heads": 4, "n_key_heads": 2, "key_dim": 8, "value_dim": 8, field: value}
    with pytest.raises(SpecError, match=rf"mixer\.{field}.*{message}"):
        zt.tiny_spec({"layers.default.mixer": {"name": "gated_deltanet", **cfg}})


# ------------------------------------------------------------------------------------ Qwen3-Next

T_LONG = 70  # past transformers' 64-token chunk: its chunked form carries a state between chunks


@pytest.fixture(scope="module")
def tiny(hf_pair):
    return hf_pair("qwen3_next")


def test_the_tiny_config_reaches_every_kind_of_layer(tiny):
    hf, model, _ = tiny
    spec = model.spec
    assert [spec.layer(i).mixer.name for i in range(4)] == ["gated_deltanet"] * 3 + ["attention"]
    assert [spec.layer(i).ffn.name for i in range(4)] == ["moe", "moe", "glu", "moe"]  # mlp_only_layers = [2]
    att = spec.layer(3).mixer
    assert att.output_gate and att.qk_norm == "head" and spec.position.rotary_fraction == 0.5
    gdn = spec.layer(0).mixer
    assert (gdn.n_heads, gdn.n_key_heads, gdn.key_dim, gdn.value_dim, gdn.conv_kernel) == (4, 2, 8, 12, 3)
    assert spec.layer(0).norm.unit_offset and spec.layer(0).ffn.shared_gate
    assert model.num_parameters() == sum(p.numel() for p in hf.parameters())


def test_every_layer_matches_transformers_layer_in_fp32(tiny):
    """Each decoder layer, given the same input (the one zoo's model gives it), computes what
    transformers' layer computes, on hidden states of up to ~50: zoo's float32 output is no further
    from transformers' float64 layer than twice transformers' own float32 layer is (about 5e-6 to
    1e-5 here, which a fixed 1e-5 met by a hair)."""
    hf, model, _ = tiny
    exact = float64_twin(hf)
    ids = torch.randint(0, 128, (2, T_LONG), generator=torch.Generator().manual_seed(0))
    seen = []
    hooks = [layer.register_forward_hook(lambda m, a, out: seen.append((a[0], out))) for layer in model.layers]
    with torch.no_grad():
        model(ids)
        for h in hooks:
            h.remove()
        causal = torch.full((T_LONG, T_LONG), float("-inf")).triu(1)[None, None]  # for the eager attention
        for i, (x, out) in enumerate(seen):
            want, truth = (
                ref.model.layers[i](x.to(dtype), position_embeddings=ref.model.rotary_emb(x.to(dtype), torch.arange(T_LONG)[None]),
                                    attention_mask=causal.to(dtype) if hf.config.layer_types[i] == "full_attention" else None)
                for ref, dtype in ((hf, torch.float32), (exact, torch.float64)))
            assert_within_reference_error(out, want, truth, what=f"layer {i}")


@pytest.mark.parametrize("std", [0.25, 0.05])
def test_logits_match_transformers_in_fp32(tmp_path, std):
    """With weights drawn at std 0.25 (hidden states up to ~45), this random model amplifies float32
    rounding: transformers' own float32 logits are 3e-4 to 5e-4 from its float64 run (each layer's
    matmuls over large activations; the error grows layer by layer), and zoo's are as far, so no
    fixed tolerance fits every machine and thread count. At std 0.05 (logits up to ~2) both are
    ~6e-6 away. Either way zoo's float32 is no further from transformers' float64 run than twice
    transformers' own float32 is."""
    hf = make_tiny("qwen3_next", tmp_path, std=std)
    exact = float64_twin(hf)
    model = zoo.from_pretrained(tmp_path).eval()
    for seed in (0, 4):
        ids = torch.randint(0, 128, (2, T_LONG), generator=torch.Generator().manual_seed(seed))
        with torch.no_grad():
            want, got, truth = hf(ids).logits, model(ids), exact(ids).logits
        assert want.abs().max() > 1.0
        assert_within_reference_error(got, want, truth, what=f"std {std}, seed {seed}")


def test_greedy_decoding_matches_transformers(tiny):
    hf, model, _ = tiny
    ids = torch.randint(0, 128, (1, 9), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        want = hf.generate(ids, max_new_tokens=12, do_sample=False, pad_token_id=0)
    got = zoo.generate(model, ids, 12)
    assert torch.equal(torch.as_tensor(got)[:, : want.shape[1]], want)


def hf_step(hf, ids, cache):
    with torch.no_grad():
        out = hf(ids, past_key_values=cache, use_cache=True)
    return out.logits, out.past_key_values


def cached(model, cache):
    """For each layer of transformers' ``cache`` what zoo's decode state holds there: each DeltaNet
    layer its recurrent matrices and its last conv_kernel - 1 convolution inputs (transformers keeps
    conv_kernel; the oldest is never read again), each attention layer the keys and values so far."""
    out = {}
    for i, layer in enumerate(cache.layers):
        if model.spec.layer(i).mixer.name == "gated_deltanet":
            out[f"layer {i} S"], out[f"layer {i} conv"] = layer.recurrent_states[0], layer.conv_states[0][..., 1:]
        else:
            out[f"layer {i} k"], out[f"layer {i} v"] = layer.keys, layer.values
    return out


def mine(model, state):
    """zoo's decode ``state`` under the names :func:`cached` gives."""
    out = {}
    for i, s in enumerate(state.layers):
        if model.spec.layer(i).mixer.name == "gated_deltanet":
            out[f"layer {i} S"], out[f"layer {i} conv"] = s.S, s.conv
        else:
            out[f"layer {i} k"], out[f"layer {i} v"] = s.k[:, :, :s.filled], s.v[:, :, :s.filled]
    return out


def test_decode_states_equal_transformers_cache_also_with_several_new_tokens(tiny):
    """Prefill 66 tokens (two of transformers' chunks), feed 3 tokens at once onto the state, then
    one at a time. transformers handles several new tokens on a cache correctly here (its chunked
    form starts from the cached state and its convolution from the cached window). At every step
    zoo's logits and every tensor of its state are no further from transformers' float64 run of the
    same steps than twice transformers' own float32 run is (this model's float32 error is large,
    see the test above); so are all its steps together from transformers' float64 full forward."""
    hf, model, _ = tiny
    exact = float64_twin(hf)
    ids = torch.randint(0, 128, (2, T_LONG + 2), generator=torch.Generator().manual_seed(4))
    cuts = [0, 66, 69, 70, 71, T_LONG + 2]
    state, cache, cache64, got, want = model.new_state(2, None), None, None, [], []
    for a, b in zip(cuts, cuts[1:]):
        with torch.no_grad():
            got.append(model(ids[:, a:b], state=state))
        logits, cache = hf_step(hf, ids[:, a:b], cache)
        truth, cache64 = hf_step(exact, ids[:, a:b], cache64)
        want.append(logits)
        assert_within_reference_error(got[-1], logits, truth, what=f"logits of tokens {a}:{b}")
        ours, theirs, theirs64 = mine(model, state), cached(model, cache), cached(model, cache64)
        assert ours.keys() == theirs.keys()
        for name in ours:
            assert ours[name].shape == theirs[name].shape, name
            assert_within_reference_error(ours[name], theirs[name], theirs64[name], what=f"{name} after {b} tokens")
    with torch.no_grad():
        full = exact(ids).logits
    assert_within_reference_error(torch.cat(got, 1), torch.cat(want, 1), full, what="all steps against one forward")


def with_mtp(path, out, **config):
    """The checkpoint at ``path`` with a random MTP module added as released checkpoints store it:
    ``mtp.fc`` (d, 2d), three zero-centred norms, and ``mtp.layers.0.*`` named and shaped as the
    file's own last layer (a gated-attention MoE layer); ``config`` fields set in config.json.
    Returns the MTP tensors."""
    out.mkdir(exist_ok=True)
    tensors = load_file(path / "model.safetensors")
    d = tensors["model.embed_tokens.weight"].shape[1]
    g = torch.Generator().manual_seed(1)
    mtp = {f"mtp.{n}.weight": 0.1 * torch.randn(d, generator=g) for n in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm")}
    mtp["mtp.fc.weight"] = torch.randn(d, 2 * d, generator=g) / d ** 0.5
    last = "model.layers.3."  # the tiny config's full-attention MoE layer
    mtp.update({"mtp.layers.0." + n[len(last):]: torch.randn(t.shape, generator=g) * 0.1
                for n, t in tensors.items() if n.startswith(last)})
    save_file({**tensors, **mtp}, out / "model.safetensors", metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps({**json.loads((path / "config.json").read_text()), **config}))
    return mtp


def test_mtp_tensors_are_loaded_into_the_mtp_module(tiny, tmp_path):
    """Released checkpoints carry an ``mtp.*`` module that transformers drops: zoo loads it. The
    block's tensors land where the same tensors stored as main layer 3 land; ``mtp.fc`` is
    ``eh_proj`` as stored (embedding half first, as vLLM's qwen3_next_mtp concatenates)."""
    _, model, path = tiny
    mtp = with_mtp(path, tmp_path / "mtp")  # no num_nextn_predict_layers: 1, as vLLM reads it
    loaded = zoo.from_pretrained(tmp_path / "mtp")
    assert loaded.spec.mtp.depth == 1 and zoo.model.mtp.mtp_layer_kind(loaded.spec) == loaded.spec.layer_kind(3) == "full_moe"
    module = loaded.mtp.layers[0]
    for hf, z in [("fc", module.eh_proj), ("pre_fc_norm_embedding", module.enorm),
                  ("pre_fc_norm_hidden", module.hnorm), ("norm", module.norm)]:
        assert torch.equal(z.weight, mtp[f"mtp.{hf}.weight"]), hf
    # The same block tensors as main layer 3, through the main layers' map.
    tensors = load_file(path / "model.safetensors")
    as_main = {"model.layers.3." + n[len("mtp.layers.0."):]: t for n, t in mtp.items() if n.startswith("mtp.layers.0.")}
    assert as_main.keys() <= tensors.keys()
    (tmp_path / "main").mkdir()
    save_file({**tensors, **as_main}, tmp_path / "main" / "model.safetensors", metadata={"format": "pt"})
    (tmp_path / "main" / "config.json").write_text((path / "config.json").read_text())
    want = zoo.from_pretrained(tmp_path / "main").layers[3].state_dict()
    got = module.block.state_dict()
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in got)
    # The main model is the one transformers wrote.
    a, b = model.state_dict(), {k: v for k, v in loaded.state_dict().items() if not k.startswith("mtp.")}
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert "mtp.*" not in zoo.checkpoints.get_format("qwen3_next").ignore


def test_the_mtp_loss_is_finite_and_reaches_the_module(tiny, tmp_path):
    _, _, path = tiny
    with_mtp(path, tmp_path, num_nextn_predict_layers=1)
    model = zoo.from_pretrained(tmp_path).train()
    ids = torch.randint(0, model.spec.vocab_size, (2, 10), generator=torch.Generator().manual_seed(0))
    out = model.loss(ids)
    assert "mtp_1" in out.aux and all(torch.isfinite(v) for v in out.aux.values())
    out.loss.backward()
    assert model.mtp.layers[0].eh_proj.weight.grad.abs().sum() > 0


def test_mtp_tensors_save_back_bit_for_bit(tiny, tmp_path):
    _, _, path = tiny
    mtp = with_mtp(path, tmp_path / "in", num_nextn_predict_layers=1)
    zoo.save_pretrained(zoo.from_pretrained(tmp_path / "in"), tmp_path / "out")
    stored, back = load_file(tmp_path / "in" / "model.safetensors"), load_file(tmp_path / "out" / "model.safetensors")
    assert back.keys() == stored.keys() and mtp.keys() <= back.keys()
    for name, t in stored.items():
        assert back[name].dtype == t.dtype and torch.equal(back[name], t), name
    assert json.loads((tmp_path / "out" / "config.json").read_text())["num_nextn_predict_layers"] == 1


def test_a_checkpoint_without_mtp_tensors_loads_the_main_model_alone(tiny, tmp_path):
    _, model, path = tiny
    config = json.loads((path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "num_nextn_predict_layers": 1}))
    (tmp_path / "model.safetensors").symlink_to(path / "model.safetensors")
    loaded = zoo.from_pretrained(tmp_path)
    assert loaded.mtp is None and loaded.spec.mtp is None
    a, b = loaded.state_dict(), model.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    zoo.save_pretrained(loaded, tmp_path / "out")
    assert json.loads((tmp_path / "out" / "config.json").read_text())["num_nextn_predict_layers"] == 0


def test_a_partial_mtp_module_or_a_second_depth_is_refused_by_name(tiny, tmp_path):
    _, _, path = tiny
    with_mtp(path, tmp_path)
    tensors = load_file(tmp_path / "model.safetensors")
    del tensors["mtp.norm.weight"]
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match="'mtp.norm.weight' is missing"):
        zoo.from_pretrained(tmp_path)
    base = {**tiny_config("qwen3_next"), "model_type": "qwen3_next"}
    with pytest.raises(ConfigError, match="'num_nextn_predict_layers'.*one MTP module"):
        config_to_spec({**base, "num_nextn_predict_layers": 2})


def test_a_state_dimension_that_disagrees_with_the_checkpoint_names_the_tensor(tiny, tmp_path):
    _, _, path = tiny
    config = json.loads((path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "linear_key_head_dim": 16}))
    (tmp_path / "model.safetensors").symlink_to(path / "model.safetensors")
    with pytest.raises(CheckpointError, match=r"linear_attn\.in_proj_qkvz\.weight.*do not fit grouped_qkvz"):
        zoo.from_pretrained(tmp_path)


def test_bad_qwen3_next_configs_name_the_field():
    base = {**tiny_config("qwen3_next"), "model_type": "qwen3_next"}
    with pytest.raises(ConfigError, match="'layer_types'.*'sliding_attention' is not supported"):
        config_to_spec({**base, "layer_types": ["linear_attention", "sliding_attention"] * 2})
    with pytest.raises(ConfigError, match="'layer_types'.*3 entries for 4 layers"):
        config_to_spec({**base, "layer_types": ["linear_attention"] * 3})
    with pytest.raises(SpecError, match="n_key_heads.*not divisible"):
        config_to_spec({**base, "linear_num_key_heads": 3})


def test_without_layer_types_every_fourth_layer_is_full_attention():
    base = {**tiny_config("qwen3_next", num_hidden_layers=8), "model_type": "qwen3_next"}
    spec = config_to_spec(base)
    hc = transformers.AutoConfig.for_model(**base)
    assert [spec.layer(i).mixer.name == "attention" for i in range(8)] == [t == "full_attention" for t in hc.layer_types]
    assert hc.layer_types[3] == "full_attention" and hc.layer_types[2] == "linear_attention"


def test_the_preset_is_the_released_model():
    """The recipe builds what the released config.json describes (the parameter count transformers
    builds from it is checked in test_released_configs.py)."""
    from pathlib import Path

    released = Path(__file__).parents[1] / "data" / "configs" / "Qwen--Qwen3-Next-80B-A3B-Instruct.json"
    from_config = config_to_spec(json.loads(released.read_text()))
    preset = zoo.get_spec("qwen3-next-80b-a3b")
    assert zoo.core.spec.differences({**preset.to_dict(), "label": None}, from_config.to_dict()) == []
    assert zoo.build("qwen3-next-80b-a3b", device="meta").num_parameters() == 79_674_391_296

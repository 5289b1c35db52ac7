"""DeepSeekMoE (``deepseek``, the remote-code layout of deepseek-ai/deepseek-moe-16b-*), which transformers
does not implement: zoo against an independent reference of the release's equations written here
(Llama attention with RoPE, softmax gate, top-k without renormalisation, ungated shared experts, a
dense first layer), on tiny random weights stored under the release's tensor names. Logits with a
left-padded row, greedy tokens, several tokens fed onto a decode state, the released config and
the preset's size, the balance loss, and bad fields named."""

import json
import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

import zoo
import zoo.testing as zt
from zoo.checkpoints import ConfigError, config_to_spec, ignored_fields
from zoo.checkpoints.tiny import tiny_config, tiny_formats

RELEASED = Path(__file__).parents[1] / "data" / "configs" / "deepseek-ai--deepseek-moe-16b-base.json"
pytestmark = pytest.mark.usefixtures("one_thread")

# Three layers (dense, sparse, sparse), GQA 4:2 heads of 16, 8 experts of 24 with top-3, 2 shared.
CONFIG = {**tiny_config("deepseek"), "model_type": "deepseek", "architectures": ["DeepseekForCausalLM"]}


def random_weights(cfg: dict, seed: int = 0) -> dict[str, torch.Tensor]:
    """Every tensor of the release's model under its name (DeepseekForCausalLM's state dict), N(0, 0.2);
    norm weights around 1."""
    g = torch.Generator().manual_seed(seed)
    d, V, H, Hkv = cfg["hidden_size"], cfg["vocab_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
    hd, E, Fm, Fd = d // H, cfg["n_routed_experts"], cfg["moe_intermediate_size"], cfg["intermediate_size"]

    def w(*shape, around=0.0):
        return around + 0.2 * torch.randn(*shape, generator=g)

    def mlp(prefix, width):
        return {f"{prefix}gate_proj.weight": w(width, d), f"{prefix}up_proj.weight": w(width, d),
                f"{prefix}down_proj.weight": w(d, width)}

    sd = {"model.embed_tokens.weight": w(V, d), "model.norm.weight": w(d, around=1.0), "lm_head.weight": w(V, d)}
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        sd.update({f"{p}input_layernorm.weight": w(d, around=1.0), f"{p}post_attention_layernorm.weight": w(d, around=1.0),
                   f"{p}self_attn.q_proj.weight": w(H * hd, d), f"{p}self_attn.k_proj.weight": w(Hkv * hd, d),
                   f"{p}self_attn.v_proj.weight": w(Hkv * hd, d), f"{p}self_attn.o_proj.weight": w(d, H * hd)})
        if i >= cfg["first_k_dense_replace"] and i % cfg["moe_layer_freq"] == 0:
            sd[f"{p}mlp.gate.weight"] = w(E, d)
            for j in range(E):
                sd.update(mlp(f"{p}mlp.experts.{j}.", Fm))
            sd.update(mlp(f"{p}mlp.shared_experts.", Fm * cfg["n_shared_experts"]))
        else:
            sd.update(mlp(f"{p}mlp.", Fd))
    return sd


def reference(sd, cfg, ids, mask=None, dtype=torch.float64):
    """The release's forward (modeling_deepseek.py's equations, eager attention), in ``dtype``."""
    sd = {k: v.to(dtype) for k, v in sd.items()}
    B, T = ids.shape
    d, H, Hkv = cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
    hd, eps, k = d // H, cfg["rms_norm_eps"], cfg["num_experts_per_tok"]
    mask = torch.ones(B, T, dtype=torch.long) if mask is None else mask
    pos = (mask.cumsum(-1) - 1).clamp(min=0)

    def rms(x, weight):
        return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))

    def mlp(x, prefix):
        silu = torch.nn.functional.silu
        return (silu(x @ sd[f"{prefix}gate_proj.weight"].T) * (x @ sd[f"{prefix}up_proj.weight"].T)) @ sd[f"{prefix}down_proj.weight"].T

    inv = 1.0 / cfg["rope_theta"] ** (torch.arange(0, hd, 2, dtype=dtype) / hd)
    ang = pos[..., None].to(dtype) * inv  # (B, T, hd/2)
    cos, sin = torch.cat([ang, ang], -1).cos()[:, None], torch.cat([ang, ang], -1).sin()[:, None]

    def rotate(x):  # (B, heads, T, hd): x cos + rotate_half(x) sin
        half = torch.cat([-x[..., hd // 2:], x[..., : hd // 2]], -1)
        return x * cos + half * sin

    allowed = torch.tril(torch.ones(T, T, dtype=torch.bool))[None] & mask.bool()[:, None, :]  # (B, T, T)
    x = sd["model.embed_tokens.weight"][ids]
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        h = rms(x, sd[f"{p}input_layernorm.weight"])
        q = (h @ sd[f"{p}self_attn.q_proj.weight"].T).view(B, T, H, hd).transpose(1, 2)
        kk = (h @ sd[f"{p}self_attn.k_proj.weight"].T).view(B, T, Hkv, hd).transpose(1, 2)
        v = (h @ sd[f"{p}self_attn.v_proj.weight"].T).view(B, T, Hkv, hd).transpose(1, 2)
        q, kk = rotate(q), rotate(kk)
        kk, v = kk.repeat_interleave(H // Hkv, 1), v.repeat_interleave(H // Hkv, 1)
        scores = (q @ kk.transpose(-1, -2)) / math.sqrt(hd)
        scores = scores.masked_fill(~allowed[:, None], torch.finfo(dtype).min)
        att = (scores.softmax(-1) @ v).transpose(1, 2).reshape(B, T, H * hd)
        x = x + att @ sd[f"{p}self_attn.o_proj.weight"].T
        h = rms(x, sd[f"{p}post_attention_layernorm.weight"])
        if f"{p}mlp.gate.weight" in sd:
            probs = (h @ sd[f"{p}mlp.gate.weight"].T).softmax(-1)
            weight, chosen = probs.topk(k, -1)
            if cfg["norm_topk_prob"]:
                weight = weight / (weight.sum(-1, keepdim=True) + 1e-20)
            y = torch.zeros_like(h)
            for j in range(cfg["n_routed_experts"]):
                w_j = (weight * (chosen == j)).sum(-1, keepdim=True)  # 0 where expert j is not chosen
                y = y + w_j * mlp(h, f"{p}mlp.experts.{j}.")
            y = y + mlp(h, f"{p}mlp.shared_experts.")
        else:
            y = mlp(h, f"{p}mlp.")
        x = x + y
    return rms(x, sd["model.norm.weight"]) @ sd["lm_head.weight"].T


def assert_close_to_reference(got, sd, cfg, ids, mask=None, where=slice(None)):
    """zoo's float32 is no further from the float64 reference than the reference's own float32 run
    (twice that, plus 1e-5): both err by the rounding of the same sums."""
    from hf_pairs import assert_within_reference_error

    exact = reference(sd, cfg, ids, mask)[where]
    own = reference(sd, cfg, ids, mask, dtype=torch.float32)[where]
    assert exact.abs().max() > 1.0
    assert_within_reference_error(got, own, exact)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    d = tmp_path_factory.mktemp("deepseek")
    sd = random_weights(CONFIG)
    save_file(sd, str(d / "model.safetensors"))
    (d / "config.json").write_text(json.dumps(CONFIG))
    return sd, zoo.from_pretrained(d).eval(), d


def ids_batch(T=20, B=2, seed=0):
    return torch.randint(0, CONFIG["vocab_size"], (B, T), generator=torch.Generator().manual_seed(seed))


def test_the_layout_becomes_a_dense_layer_then_sparse_ones(checkpoint):
    _, ours, _ = checkpoint
    spec = ours.spec
    assert [spec.layer(i).ffn.name for i in range(3)] == ["glu", "moe", "moe"]
    moe = spec.layer(1).ffn
    assert (moe.n_experts, moe.top_k, moe.d_ff, moe.shared_d_ff, moe.shared_gate) == (8, 3, 24, 48, False)
    assert moe.router.name == "softmax_topk" and not moe.norm_topk_prob
    # The release's seq_aux balance loss, weight aux_loss_alpha (its default 0.001): zoo's sequence_loss
    # (tests/parts/test_moe.py checks that loss against DeepSeek's formula).
    assert moe.sequence_loss == 0.001 and not (moe.switch_loss or moe.device_loss)
    assert spec.layer(0).mixer.n_kv_heads == 2 and spec.position.layout == "half"


def test_logits_match_the_reference_with_a_left_padded_row(checkpoint):
    sd, ours, _ = checkpoint
    ids = ids_batch()
    mask = torch.ones_like(ids)
    mask[1, :6] = 0
    with torch.no_grad():
        got = ours(ids, attention_mask=mask)
    real = mask.bool()
    assert_close_to_reference(got[real], sd, CONFIG, ids, mask, where=real)


def test_several_tokens_onto_a_state_and_greedy_tokens(checkpoint):
    sd, ours, _ = checkpoint
    ids = ids_batch(T=23, seed=3)
    with torch.no_grad():
        state = ours.new_state(2, None)
        parts = [ours(ids[:, a:b], state=state) for a, b in ((0, 7), (7, 19), (19, 23))]
    assert_close_to_reference(torch.cat(parts, 1), sd, CONFIG, ids)
    prompt = ids[:, :6]
    with torch.no_grad():
        got = zoo.generate(ours, prompt, max_new_tokens=6)
    want = prompt
    for _ in range(6):  # the reference's greedy step: argmax of the last position, fed back in
        want = torch.cat([want, reference(sd, CONFIG, want)[:, -1].argmax(-1, keepdim=True)], 1)
    assert torch.equal(got, want)


def test_decoding_conformance(checkpoint):
    _, ours, _ = checkpoint
    zt.check_decoding(ours, ids_batch(T=13), what="deepseek", atol=1e-5)


def test_saving_writes_the_release_layout(checkpoint, tmp_path):
    sd, ours, _ = checkpoint
    zoo.save_pretrained(ours, tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    assert saved["model_type"] == "deepseek" and saved["architectures"] == ["DeepseekForCausalLM"]
    for key in ("n_routed_experts", "n_shared_experts", "first_k_dense_replace", "moe_layer_freq", "norm_topk_prob",
                "moe_intermediate_size", "num_experts_per_tok", "rope_theta", "num_key_value_heads"):
        assert saved[key] == CONFIG[key], key
    assert saved["scoring_func"] == "softmax" and saved["seq_aux"] is True and saved["rope_scaling"] is None
    assert "rope_parameters" not in saved and "head_dim" not in saved
    from safetensors.torch import load_file

    back = load_file(str(tmp_path / "model.safetensors"))
    assert back.keys() == sd.keys()
    for name in sd:
        assert torch.equal(back[name], sd[name]), name


def test_moe_layer_freq_skips_layers():
    spec = config_to_spec({**CONFIG, "num_hidden_layers": 5, "moe_layer_freq": 2})
    assert [spec.layer(i).ffn.name for i in range(5)] == ["glu", "glu", "moe", "glu", "moe"]


def test_the_released_config_is_read_whole():
    config = json.loads(RELEASED.read_text())
    assert config["model_type"] == "deepseek"
    spec = config_to_spec(config, strict=True)  # every field of the release read, none left over
    assert ignored_fields(config) == []
    assert [spec.layer(i).ffn.name for i in range(3)] == ["glu", "moe", "moe"] and spec.n_layers == 28
    moe = spec.layer(1).ffn
    assert (moe.n_experts, moe.top_k, moe.d_ff, moe.shared_d_ff) == (64, 6, 1408, 2816)
    assert spec.layer(0).mixer.n_heads == spec.layer(0).mixer.n_kv_heads == 16 and spec.max_seq_len == 4096


def release_count(cfg: dict) -> tuple[int, int]:
    """Total and active parameters of the release's modules for ``cfg``, counted from the shapes of
    modeling_deepseek.py's layers (total; active = top-k of the routed experts)."""
    d, V, L = cfg["hidden_size"], cfg["vocab_size"], cfg["num_hidden_layers"]
    hd = d // cfg["num_attention_heads"]
    attn = d * cfg["num_attention_heads"] * hd * 2 + d * cfg["num_key_value_heads"] * hd * 2
    expert = 3 * d * cfg["moe_intermediate_size"]
    sparse = [i >= cfg["first_k_dense_replace"] and i % cfg["moe_layer_freq"] == 0 for i in range(L)]
    shared = expert * cfg["n_shared_experts"]
    total = active = 2 * V * d + d + L * (attn + 2 * d)
    for s in sparse:
        dense = 3 * d * cfg["intermediate_size"]
        total += cfg["n_routed_experts"] * d + cfg["n_routed_experts"] * expert + shared if s else dense
        active += cfg["n_routed_experts"] * d + cfg["num_experts_per_tok"] * expert + shared if s else dense
    return total, active


def test_the_preset_is_the_released_model():
    config = json.loads(RELEASED.read_text())
    total, active = release_count(config)
    assert (total, active) == (16_375_728_128, 2_828_650_496)  # the release's "16.4B", "2.8B activated"
    model = zoo.build("deepseek-moe-16b", device="meta")
    assert model.num_parameters() == total
    assert zoo.core.spec.differences(config_to_spec(config).to_dict(), model.spec.to_dict()) == [
        ("label", None, "deepseek-moe-16b")]
    from zoo.tools.accounting import account

    embedding = config["vocab_size"] * config["hidden_size"]
    assert account(model)["params"]["active_conventions"] == {
        "with_embeddings_and_head": active, "without_input_embedding": active - embedding,
        "without_embeddings_and_head": active - 2 * embedding}


def test_not_made_by_transformers_but_checked_here():
    assert "deepseek" not in tiny_formats()  # zoo verify --tiny compares with transformers, which has none
    transformers = pytest.importorskip("transformers")
    assert "deepseek" not in transformers.CONFIG_MAPPING


@pytest.mark.parametrize("field,value,match", [
    ("scoring_func", "sigmoid", "scoring_func"), ("seq_aux", False, "seq_aux"), ("moe_layer_freq", 0, "moe_layer_freq"),
    ("n_routed_experts", None, "n_routed_experts"), ("n_shared_experts", 0, "n_shared_experts"),
    ("rope_scaling", {"type": "yarn", "factor": 2.0}, "rope_scaling"), ("first_k_dense_replace", 3, "first_k_dense_replace"),
    ("num_experts_per_tok", "6", "num_experts_per_tok"), ("aux_loss_alpha", -0.1, "aux_loss_alpha")])
def test_bad_fields_are_named(field, value, match):
    with pytest.raises(ConfigError, match=f"'{match}'"):
        config_to_spec({**CONFIG, field: value})

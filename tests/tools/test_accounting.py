"""Resource accounting against the lecture notes' formulas and worked examples, computed by hand
here, and against what the real KV cache holds."""

import pytest
import torch

import zoo
from zoo.tools.accounting import account


def test_llama2_70b_kv_cache_worked_example():
    # Lecture 3, section 10.1: 2 * 80 layers * 8 kv heads * 128 * 2 bytes (bf16) per token.
    gqa = account("llama2-70b", context=4096, batch=64, dtype="bf16")
    assert gqa["kv_cache"]["bytes_per_token"] == 2 * 80 * 8 * 128 * 2 == 327_680  # ~0.33 MB
    assert gqa["shape"]["attention"] == "GQA-8"
    mha = account("llama2-70b", context=4096, batch=64, overrides={"layers.*.mixer.n_kv_heads": 64})
    assert mha["kv_cache"]["bytes_per_token"] == 2 * 80 * 64 * 128 * 2 == 2_621_440  # ~2.6 MB, 8x
    # 4k context x batch 64: GQA needs 85.9 GB and MHA 687 GB. The notes call it "85 GB vs
    # 10.7 GB"; 10.7 GB is GQA at batch 8 (docs/reference/accounting.md).
    assert gqa["kv_cache"]["bytes"] == 327_680 * 4096 * 64 == 85_899_345_920
    assert mha["kv_cache"]["bytes"] == 2_621_440 * 4096 * 64 == 687_194_767_360
    assert account("llama2-70b", context=4096, batch=8)["kv_cache"]["bytes"] == 10_737_418_240


def test_parameters_flops_and_shape_of_llama2_7b():
    a = account("llama2-7b", context=4096, dtype="bf16")
    V, d, L, dff = 32000, 4096, 32, 11008
    per_layer = 4 * d * d + 3 * d * dff + 2 * d  # q, k, v, o; gate, up, down; two RMSNorm weights
    non_embedding = L * per_layer + d  # + final norm
    assert a["params"]["non_embedding"] == non_embedding
    assert a["params"]["embedding"] == 2 * V * d  # embedding and the untied head
    assert a["params"]["total"] == 6_738_415_616 == a["params"]["published"]
    n = non_embedding + V * d  # every weight a token is multiplied by: the head, not the lookup
    assert a["flops"]["forward_per_token_2n"] == 2 * n
    assert a["flops"]["mixing_per_token_at_context"] == L * 4 * 32 * 128 * 4096  # 4 h t d_h per layer
    assert a["flops"]["training_per_token_6n"] == 6 * n
    # Training ~ 3x the forward, averaged over a causal sequence (a token sees (T+1)/2 keys on average).
    mean_attention = L * 4 * 32 * 128 * (4096 + 1) / 2
    assert a["flops"]["training_per_token"] == pytest.approx(3 * (2 * n + mean_attention))
    assert a["shape"]["aspect_ratio"] == 128
    assert a["shape"]["d_ff_over_d_model"] == pytest.approx(11008 / 4096)  # the notes' 8/3 rounded up to 256
    assert a["memory"]["weights_bytes"] == 2 * 6_738_415_616
    assert a["memory"]["adamw_mixed_precision_bytes"] == 16 * 6_738_415_616


def test_aspect_ratios_from_the_notes():
    assert account("gpt3-175b")["shape"]["aspect_ratio"] == 12288 / 96 == 128
    assert account("llama3-70b")["shape"]["aspect_ratio"] == pytest.approx(102.4)


def test_sliding_windows_bound_the_cache():
    # Mistral 7B v0.1: window 4096 on every layer; beyond it the cache stops growing.
    at_window = account("mistral-7b", context=4096)["kv_cache"]["bytes"]
    assert account("mistral-7b", context=32768)["kv_cache"]["bytes"] == at_window == 2 * 32 * 8 * 128 * 2 * 4096
    # Gemma 2 2B at 8192: 13 local layers hold 4096 tokens, 13 global layers all 8192.
    g = account("gemma2-2b", context=8192, batch=2, dtype="fp32")
    assert g["kv_cache"]["bytes"] == 2 * 4 * 256 * 4 * (13 * 4096 + 13 * 8192) * 2
    assert g["shape"]["window"] == {"local": 4096, "global": None}


def test_largest_preset_on_the_meta_device():
    a = account("llama3.1-405b", context=131072, dtype="bf16")
    assert a["params"]["total"] == zoo.published_params("llama3.1-405b")
    assert a["kv_cache"]["bytes_per_token"] == 2 * 126 * 8 * 128 * 2


@pytest.mark.parametrize("name,extra", [("llama2-7b", {}), ("gemma2-2b", {"layers.local.mixer.window": 3})])
@torch.no_grad()
def test_account_matches_what_the_cache_holds(name, extra):
    tiny = {"n_layers": 2, "d_model": 64, "vocab_size": 128, "layers.*.ffn.d_ff": 96,
            "layers.*.mixer.n_heads": 4, "layers.*.mixer.n_kv_heads": 2, "layers.*.mixer.head_dim": 16}
    model = zoo.build(name, overrides={**tiny, **extra}, seed=0).eval()
    state = model.new_state(3, 10)
    model(torch.randint(0, 128, (3, 10)), state=state)
    assert state.nbytes() == account(model, context=10, batch=3, dtype=torch.float32)["kv_cache"]["bytes"]


def test_unknown_dtype_is_named():
    with pytest.raises(ValueError, match="unknown dtype 'fp7'"):
        account("llama2-7b", dtype="fp7")

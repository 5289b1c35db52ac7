"""Every preset builds, with its published parameter count, and its shapes match transformers'."""

from collections import Counter

import pytest
import torch

import zoo

from hf_pairs import own

# Parameter counts as published with the released weights (tied embeddings counted once).
PUBLISHED = {
    "llama2-7b": 6_738_415_616,
    "llama2-13b": 13_015_864_320,
    "llama2-70b": 68_976_648_192,
    "llama3-8b": 8_030_261_248,
    "llama3-70b": 70_553_706_496,
    "llama3.1-8b": 8_030_261_248,
    "llama3.1-70b": 70_553_706_496,
    "llama3.1-405b": 405_853_388_800,
    "llama3.2-1b": 1_235_814_400,
    "llama3.2-3b": 3_212_749_824,
    "gemma2-2b": 2_614_341_888,
    "gemma2-9b": 9_241_705_984,
    "gemma2-27b": 27_227_128_320,
    "gemma3-1b": 999_885_952,
    "mistral-7b": 7_241_732_096,
    "mistral-7b-v0.3": 7_248_023_552,
    "olmo2-7b": 7_298_617_344,
}


@pytest.mark.parametrize("name", zoo.list_models())
def test_every_preset_builds_on_meta_without_allocating(name):
    model = zoo.build(name, device="meta")
    assert all(p.is_meta for p in model.parameters())
    assert model.num_parameters() > 0
    if name in PUBLISHED:
        assert model.num_parameters() == PUBLISHED[name]
    recorded = zoo.published_params(name)
    if recorded is not None:  # the recipe's own record agrees with the published count
        assert recorded == PUBLISHED.get(name, model.num_parameters())  # (plugin presets: not listed here)


def test_paper_counts_for_presets_without_weights():
    # GPT-3 Table 2.1 and PaLM Table 1 give rounded sizes; the recipes land on them.
    approx = {"gpt3-125m": 125e6, "gpt3-350m": 350e6, "gpt3-760m": 760e6, "gpt3-1.3b": 1.3e9,
              "gpt3-2.7b": 2.7e9, "gpt3-6.7b": 6.7e9, "gpt3-13b": 13e9, "gpt3-175b": 175e9,
              "palm-8b": 8.63e9, "palm-62b": 62.50e9, "palm-540b": 540.35e9}
    for name, size in approx.items():
        n = zoo.build(name, device="meta").num_parameters()
        assert abs(n - size) / size < 0.04, (name, n)
    # GPT-3 XL: Table 2.1 prints 24 heads of 128 on d_model 2048 (1.52B parameters), but its own total
    # is 1.3B, which 16 heads of 128 give; the preset follows the total and notes the printing.
    xl = zoo.build("gpt3-1.3b", device="meta")
    assert xl.layers[0].mixer.q_proj.weight.shape == (16 * 128, 2048)
    d, a, v, ctx, layers = 2048, 16 * 128, 50257, 2048, 24
    per_layer = 3 * (d * a + a) + (a * d + d) + (d * 4 * d + 4 * d) + (4 * d * d + d) + 2 * 2 * d
    assert xl.num_parameters() == layers * per_layer + v * d + ctx * d + 2 * d == 1_315_723_264


def shrink(name: str) -> zoo.Decoder:
    """A tiny version of a preset: same parts and wiring, small dimensions, windows of 8."""
    spec = zoo.get_spec(name)
    kinds = [spec.layer_kind(i) for i in range(spec.n_layers)]
    n_layers = max(2, *(kinds.index(k) + 1 for k in set(kinds)))  # every layer kind present
    over = {"d_model": 64, "vocab_size": 128, "max_seq_len": 64, "n_layers": n_layers}
    for kind, layer in spec.layers.items():
        if layer.ffn.d_ff is not None:
            over[f"layers.{kind}.ffn.d_ff"] = 96
        att = layer.mixer
        if att.name != "attention":  # another mixer (a recurrent one, MLA) shrinks itself, if it has sizes
            sizes = getattr(att.cls, "shrink", None)
            over.update({f"layers.{kind}.mixer.{k}": v for k, v in (sizes(att.config) if sizes else {}).items()})
            continue
        base = f"layers.{kind}.mixer"
        kv = att.n_kv_heads
        over[f"{base}.n_heads"] = 4
        over[f"{base}.n_kv_heads"] = None if kv is None else (1 if kv == 1 else 2)
        if att.head_dim is not None:
            over[f"{base}.head_dim"] = 24  # head_dim independent of d_model / n_heads
        if att.window is not None:
            over[f"{base}.window"] = 8
        if att.scale_dim is not None:
            over[f"{base}.scale_dim"] = 20.0
    if spec.embedding.padded_vocab_size is not None:
        over["embedding.padded_vocab_size"] = 136
    if spec.position is not None:  # a fixed rotary width shrinks with the heads (the part says how)
        over.update({f"position.{k}": v for k, v in spec.position.cls.shrink(spec.position.config, head_dim=24).items()})
    return zoo.build(name, overrides=over, seed=0)


FAMILY_REPRESENTATIVES = sorted({zoo.model.recipes.find_preset(n)[0].name: n for n in zoo.list_models()}.values())


@pytest.mark.parametrize("name", FAMILY_REPRESENTATIVES)
def test_shrunk_family_runs_forward_and_backward(name):
    model = shrink(name)
    ids = torch.randint(0, 128, (2, 20))
    logits = model(ids)
    assert logits.shape == (2, 20, 128) and torch.isfinite(logits).all()
    out = model.loss(ids)
    out.loss.backward()
    grads = {n: p.grad for n, p in model.named_parameters()}
    missing = [n for n, g in grads.items() if g is None]
    assert not missing, f"parameters without gradient: {missing}"
    assert all(torch.isfinite(g).all() for g in grads.values())
    # causal: the first half's logits ignore the second half
    model.eval()
    with torch.no_grad():
        a = model(ids)
        b = model(torch.cat([ids[:, :10], torch.randint(0, 128, (2, 10))], dim=1))
    torch.testing.assert_close(a[:, :10], b[:, :10], rtol=1e-5, atol=1e-5)


def test_every_family_has_a_representative():
    families = {zoo.model.recipes.find_preset(n)[0].name for n in FAMILY_REPRESENTATIVES}
    assert families == own("family", installed=True)  # zoo's and installed distributions', not a test module's


# ---------------------------------------------------------------------------------------------
# transformers builds the same model from the same real config (on the meta device)
# ---------------------------------------------------------------------------------------------

def _hf_configs():
    tf = pytest.importorskip("transformers")

    def llama(vocab, d, layers, heads, kv, ff, tied=False, head_dim=None, cls=tf.LlamaConfig, **kw):
        return cls(vocab_size=vocab, hidden_size=d, num_hidden_layers=layers, num_attention_heads=heads,
                   num_key_value_heads=kv, intermediate_size=ff, tie_word_embeddings=tied,
                   **({"head_dim": head_dim} if head_dim else {}), **kw)

    def gemma(cls, vocab, d, layers, heads, kv, head_dim, ff, **kw):
        return cls(vocab_size=vocab, hidden_size=d, num_hidden_layers=layers, num_attention_heads=heads,
                   num_key_value_heads=kv, head_dim=head_dim, intermediate_size=ff, **kw)

    return {
        "llama2-7b": llama(32000, 4096, 32, 32, 32, 11008),
        "llama2-13b": llama(32000, 5120, 40, 40, 40, 13824),
        "llama2-70b": llama(32000, 8192, 80, 64, 8, 28672),
        "llama3-8b": llama(128256, 4096, 32, 32, 8, 14336),
        "llama3.1-70b": llama(128256, 8192, 80, 64, 8, 28672),
        "llama3.1-405b": llama(128256, 16384, 126, 128, 8, 53248),
        "llama3.2-1b": llama(128256, 2048, 16, 32, 8, 8192, tied=True, head_dim=64),
        "llama3.2-3b": llama(128256, 3072, 28, 24, 8, 8192, tied=True, head_dim=128),
        "mistral-7b": llama(32000, 4096, 32, 32, 8, 14336, cls=tf.MistralConfig),
        "mistral-7b-v0.3": llama(32768, 4096, 32, 32, 8, 14336, cls=tf.MistralConfig),
        "olmo2-7b": llama(100352, 4096, 32, 32, 32, 11008, cls=tf.Olmo2Config),
        "olmo2-13b": llama(100352, 5120, 40, 40, 40, 13824, cls=tf.Olmo2Config),
        "gemma2-2b": gemma(tf.Gemma2Config, 256000, 2304, 26, 8, 4, 256, 9216),
        "gemma2-9b": gemma(tf.Gemma2Config, 256000, 3584, 42, 16, 8, 256, 14336),
        "gemma2-27b": gemma(tf.Gemma2Config, 256000, 4608, 46, 32, 16, 128, 36864),
        "gemma3-1b": gemma(tf.Gemma3TextConfig, 262144, 1152, 26, 4, 1, 256, 6912),
        "gemma3-4b": gemma(tf.Gemma3TextConfig, 262208, 2560, 34, 8, 4, 256, 10240),
        "gemma3-12b": gemma(tf.Gemma3TextConfig, 262208, 3840, 48, 16, 8, 256, 15360),
        "gemma3-27b": gemma(tf.Gemma3TextConfig, 262208, 5376, 62, 32, 16, 128, 21504),
    }


def _shapes(module: torch.nn.Module) -> Counter:
    return Counter(tuple(p.shape) for p in module.parameters())


@pytest.mark.parametrize("name", [
    "llama2-7b", "llama2-13b", "llama2-70b", "llama3-8b", "llama3.1-70b", "llama3.1-405b", "llama3.2-1b",
    "llama3.2-3b", "mistral-7b", "mistral-7b-v0.3", "olmo2-7b", "olmo2-13b", "gemma2-2b", "gemma2-9b",
    "gemma2-27b", "gemma3-1b", "gemma3-4b", "gemma3-12b", "gemma3-27b",
])
def test_transformers_builds_the_same_parameter_shapes(name):
    from transformers import AutoModelForCausalLM

    config = _hf_configs()[name]
    with torch.device("meta"):
        ref = AutoModelForCausalLM.from_config(config)
    ours = zoo.build(name, device="meta")
    assert ours.num_parameters() == sum(p.numel() for p in ref.parameters())
    assert _shapes(ours) == _shapes(ref)


def test_gpt3_small_matches_gpt2_with_a_2048_context():
    # GPT-3's block is GPT-2's: the 125M preset has GPT-2 small's parameters with 2048 positions.
    from transformers import AutoModelForCausalLM, GPT2Config

    with torch.device("meta"):
        ref = AutoModelForCausalLM.from_config(GPT2Config(n_positions=2048, n_embd=768, n_layer=12, n_head=12))
    assert zoo.build("gpt3-125m", device="meta").num_parameters() == sum(p.numel() for p in ref.parameters())


def test_forward_with_labels_is_the_loss():
    model = shrink("llama2-7b")
    ids = torch.randint(0, 128, (2, 12))
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    via_forward = model(ids, attention_mask=mask, labels=ids)
    direct = model.loss(ids, attention_mask=mask)
    logits = model(ids, attention_mask=mask)
    labels = ids.masked_fill(mask == 0, -100)
    reference = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, 128), labels[:, 1:].reshape(-1))
    torch.testing.assert_close(via_forward.loss, direct.loss)
    torch.testing.assert_close(via_forward.ce, reference)


def test_building_the_largest_preset_on_meta_needs_no_torch_decompositions():
    # Building on meta skips torch's throw-away random init, which would pull in torch's Python
    # decompositions (and sympy) and take over a second in a fresh process.
    import subprocess
    import sys

    code = ("import sys, zoo; m = zoo.build('llama3.1-405b', device='meta'); "
            "import torch.nn as nn; print(m.num_parameters(), 'sympy' in sys.modules, "
            "nn.Linear.reset_parameters.__name__)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == [str(PUBLISHED["llama3.1-405b"]), "False", "reset_parameters"]

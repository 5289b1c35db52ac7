"""FP8 checkpoints kept as FP8 (``from_pretrained(..., fp8="keep")``): each linear layer's weight stays
float8_e4m3fn beside its block scales in an FP8Linear, and each MoE's routed experts stay float8 stacks
beside their stacked scales in FP8Experts; on the CPU each weight is dequantised for its own product.

The reference is the dequantising load of the same checkpoint (tests/formats/test_fp8.py checks that
against transformers and an independent dequantisation): the same numbers through the same
operations, so the logits are equal, not close.
"""

import json
import sys

import pytest
import torch
from safetensors.torch import load_file

import zoo
from zoo.checkpoints import CheckpointError
from zoo.checkpoints.quantized import FP8Experts, FP8Linear, quantize_activations, scaled_mm_supported
from zoo.checkpoints.tiny import make_tiny

from test_fp8 import IDS, logits, quantized_checkpoint, rewrite

pytest.importorskip("transformers")


def dequantised(path, **kwargs):
    """The reference: the dequantising load, its routed experts run expert by expert as the kept ones
    are (the grouped matmul it would take where widths align sums in another order: equal to
    rounding, not bit for bit)."""
    from zoo.components.ffn.moe import GroupedExperts

    model = zoo.from_pretrained(path, **kwargs)
    for m in model.modules():
        if isinstance(m, GroupedExperts):
            m.dispatch = "loop"
    return model


@pytest.fixture(scope="module")
def deepseek(tmp_path_factory):
    """A tiny DeepSeek-V3 in 32 x 32 blocks (MLA projections, dense FFN, shared and routed experts,
    all with partial blocks), its routers' selection bias randomised."""
    root = tmp_path_factory.mktemp("dsv3")
    make_tiny("deepseek_v3", root / "hf", std=0.1)
    rewrite(root / "hf", lambda t: t.update({n: torch.randn(v.shape, generator=torch.Generator().manual_seed(1))
                                             for n, v in t.items() if n.endswith("e_score_correction_bias")}))
    quantized_checkpoint(root / "hf", root / "fp8", block=32)
    return root / "fp8"


def test_linear_weights_stay_fp8_and_the_logits_equal_the_dequantised_model(deepseek):
    kept, ref = zoo.from_pretrained(deepseek, fp8="keep"), dequantised(deepseek)
    mla, dense, moe = kept.layers[1].mixer, kept.layers[0].ffn, kept.layers[1].ffn
    for m in (mla.q_a_proj, mla.q_b_proj, mla.kv_a_proj, mla.kv_b_proj, mla.o_proj, dense.gate, dense.down,
              moe.shared.up):
        assert isinstance(m, FP8Linear) and m.weight.dtype == torch.float8_e4m3fn
    stored = load_file(deepseek / "model.safetensors")
    assert torch.equal(mla.kv_b_proj.weight.view(torch.uint8),
                       stored["model.layers.1.self_attn.kv_b_proj.weight"].view(torch.uint8))
    assert torch.equal(mla.kv_b_proj.weight_scale_inv, stored["model.layers.1.self_attn.kv_b_proj.weight_scale_inv"])
    # The routed experts (one tensor per expert, stacked) stay float8 with their stacked scales; the
    # routers were never quantised.
    experts = moe.experts
    assert isinstance(experts, FP8Experts) and moe.router.weight.dtype == torch.float32
    for name, hf in (("w_gate", "gate_proj"), ("w_up", "up_proj"), ("w_down", "down_proj")):
        w, s = getattr(experts, name), getattr(experts, name + "_scale_inv")
        assert w.dtype == torch.float8_e4m3fn and not w.requires_grad
        for e in (0, 5):
            key = f"model.layers.1.mlp.experts.{e}.{hf}.weight"
            assert torch.equal(w[e].view(torch.uint8), stored[key].view(torch.uint8))
            assert torch.equal(s[e], stored[key + "_scale_inv"])
        assert torch.equal(experts.dense_weight(name), getattr(ref.layers[1].ffn.experts, name))
    assert torch.equal(logits(kept), logits(ref))
    # In bf16: each weight the fp32 dequantisation rounded once, as the dequantising load rounds it.
    kept16, ref16 = zoo.from_pretrained(deepseek, fp8="keep", dtype=torch.bfloat16), dequantised(deepseek, dtype=torch.bfloat16)
    assert kept16.layers[1].mixer.o_proj.weight.dtype == torch.float8_e4m3fn
    assert torch.equal(logits(kept16), logits(ref16))


def test_decoding_reads_the_dequantised_up_projection(deepseek):
    """MLA's absorbed decode folds kv_b_proj's weight into the queries: it asks for the full-precision weight."""
    kept, ref = zoo.from_pretrained(deepseek, fp8="keep"), dequantised(deepseek)
    a = zoo.generate(kept, IDS[:, :8], max_new_tokens=6)
    assert torch.equal(a, zoo.generate(ref, IDS[:, :8], max_new_tokens=6))


def test_deepseek_v32_keeps_its_indexer_in_fp8(tmp_path):
    """DSA's lightning indexer casts its input to its weights projection's dtype: kept in FP8, that is
    the dtype it computes in, not float8."""
    make_tiny("deepseek_v32", tmp_path / "hf", std=0.1)
    quantized_checkpoint(tmp_path / "hf", tmp_path / "fp8", block=32)
    kept, ref = zoo.from_pretrained(tmp_path / "fp8", fp8="keep"), dequantised(tmp_path / "fp8")
    assert isinstance(kept.layers[0].mixer.indexer.weights_proj, FP8Linear)
    assert torch.equal(logits(kept), logits(ref))
    assert torch.equal(zoo.generate(kept, IDS[:, :8], max_new_tokens=4), zoo.generate(ref, IDS[:, :8], max_new_tokens=4))


def test_to_a_dtype_keeps_the_fp8_numbers(deepseek):
    kept = zoo.from_pretrained(deepseek, fp8="keep").to(torch.bfloat16)
    o = kept.layers[1].mixer.o_proj
    assert o.weight.dtype == torch.float8_e4m3fn and o.weight_scale_inv.dtype == torch.float32
    assert o.compute_dtype == torch.bfloat16
    assert torch.equal(logits(kept), logits(dequantised(deepseek).to(torch.bfloat16)))


def test_save_writes_the_fp8_tensors_and_scales_unchanged(deepseek, tmp_path):
    model = zoo.from_pretrained(deepseek, fp8="keep")
    zoo.save_pretrained(model, tmp_path / "out")
    source, saved = load_file(deepseek / "model.safetensors"), load_file(tmp_path / "out" / "model.safetensors")
    assert set(saved) == set(source)
    for name, t in source.items():  # every float8 weight (routed experts too) and every scale, byte for byte
        if t.dtype == torch.float8_e4m3fn:
            assert saved[name].dtype == t.dtype and torch.equal(saved[name].view(torch.uint8), t.view(torch.uint8)), name
            assert torch.equal(saved[name + "_scale_inv"], source[name + "_scale_inv"]), name
    assert any(".experts.7.down_proj.weight" in n for n in source)
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["quantization_config"] == json.loads((deepseek / "config.json").read_text())["quantization_config"]
    again = zoo.from_pretrained(tmp_path / "out", fp8="keep")
    assert torch.equal(logits(again), logits(model))


def test_routed_experts_kept_in_fp8_decode_and_move_like_the_dequantised_model(deepseek):
    """Several tokens fed onto a decode state, and ``.to(bfloat16)``: the experts' numbers stay float8, they
    compute in the new dtype, and each step equals the dequantised model's."""
    kept = zoo.from_pretrained(deepseek, fp8="keep").to(torch.bfloat16)
    ref = dequantised(deepseek).to(torch.bfloat16)
    experts = kept.layers[1].ffn.experts
    assert experts.w_down.dtype == torch.float8_e4m3fn and experts.w_down_scale_inv.dtype == torch.float32
    assert experts.compute_dtype == torch.bfloat16
    assert torch.equal(logits(kept), logits(ref))
    a = zoo.generate(kept, IDS[:, :8], max_new_tokens=6)
    assert torch.equal(a, zoo.generate(ref, IDS[:, :8], max_new_tokens=6))


def test_to_a_dtype_never_converts_the_fp8_numbers(deepseek):
    """``.to(bfloat16)`` and back: no float8 tensor is ever converted, not even as a temporary (for a
    DeepSeek-V3 layer's experts that would be 22 GB in bf16), and the weights keep their storage."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Casts(TorchDispatchMode):
        seen: list = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            t = args[0] if args else None
            if isinstance(t, torch.Tensor) and t.dtype == torch.float8_e4m3fn and t.numel() \
                    and isinstance(out, torch.Tensor) and out.dtype != t.dtype:
                self.seen.append(str(func))
            return out

    kept = zoo.from_pretrained(deepseek, fp8="keep")
    experts, o = kept.layers[1].ffn.experts, kept.layers[1].mixer.o_proj
    before = experts.w_up.data_ptr(), o.weight.data_ptr()
    with Casts() as casts:
        kept.to(torch.bfloat16).to(torch.float32)
    assert casts.seen == []
    assert (experts.w_up.data_ptr(), o.weight.data_ptr()) == before
    assert experts.compute_dtype == o.compute_dtype == torch.float32


def test_an_expert_with_no_tokens_is_never_dequantised(deepseek, monkeypatch):
    """The experts run one at a time and only those that have tokens: one token's forward through a
    top-k MoE dequantises k experts' matrices per layer, each one expert wide, never a layer's stack."""
    import zoo.checkpoints.quantized as q

    kept = zoo.from_pretrained(deepseek, fp8="keep")
    experts = kept.layers[1].ffn.experts
    n_experts, k = experts.w_up.shape[0], kept.spec.layer(1).ffn.config.top_k
    shapes, real = [], q.dequantize_blocks
    monkeypatch.setattr(q, "dequantize_blocks", lambda w, *a: shapes.append(tuple(w.shape)) or real(w, *a))
    with torch.no_grad():
        kept.layers[1].ffn(torch.randn(1, 1, kept.spec.d_model))
    per_expert = [s for s in shapes if s in {tuple(experts.w_up.shape[1:]), tuple(experts.w_down.shape[1:])}]
    assert len(per_expert) == 3 * k < 3 * n_experts, shapes
    assert all(len(s) == 2 for s in shapes)


def test_a_hostile_expert_scale_is_refused_by_name(deepseek, tmp_path):
    """A NaN in one routed expert's scale: the load stops naming that scale, as for any kept weight."""
    import shutil

    shutil.copytree(deepseek, tmp_path / "bad")
    name = "model.layers.1.mlp.experts.3.up_proj.weight_scale_inv"
    rewrite(tmp_path / "bad", lambda t: t[name].view(-1)[0].fill_(float("nan")))
    with pytest.raises(CheckpointError, match=rf"{name}.*nan.*corrupt"):
        zoo.from_pretrained(tmp_path / "bad", fp8="keep")


def test_fp8_takes_dequantize_or_keep(deepseek):
    with pytest.raises(ValueError, match=r"fp8='fp4'.*'dequantize'.*'keep'"):
        zoo.from_pretrained(deepseek, fp8="fp4")


def test_an_unquantised_checkpoint_loads_as_it_is_with_keep(deepseek, tmp_path):
    hf = deepseek.parent / "hf"
    assert torch.equal(logits(zoo.from_pretrained(hf, fp8="keep")), logits(zoo.from_pretrained(hf)))


def test_the_activation_quantiser_of_the_gpu_path():
    """Per 1 x 128 group: amax / 448, so each group's largest value is exactly 448 times its scale and
    every value is within e4m3 rounding (2^-4 relative, or 2^-10 of the scale below the normal range)."""
    x = torch.randn(5, 256, generator=torch.Generator().manual_seed(0), dtype=torch.float64) * 3
    q, scale = quantize_activations(x)
    assert q.dtype == torch.float8_e4m3fn and scale.shape == (5, 2)
    back = q.double().unflatten(-1, (2, 128)) * scale[..., None]
    g = x.unflatten(-1, (2, 128))
    assert ((back - g).abs() <= g.abs() * 2**-4 + scale[..., None] * 2**-10).all()
    assert torch.equal(q.float().unflatten(-1, (2, 128)).abs().amax(-1), torch.full((5, 2), 448.0))
    assert not scaled_mm_supported(torch.device("cpu"))


LLAMA = {"hidden_size": 512, "intermediate_size": 1536, "num_hidden_layers": 4, "num_attention_heads": 8,
         "num_key_value_heads": 4, "head_dim": 64, "vocab_size": 256}
# 64 routed experts of 256 x 256 (one MoE layer: the tiny config keeps layer 0 dense): 12.6M of the
# model's 13.2M parameters are experts.
MOE = {"hidden_size": 256, "moe_intermediate_size": 256, "num_experts": 64, "num_experts_per_tok": 4,
       "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64, "vocab_size": 256}


def held_bytes(model):
    return sum(t.nbytes for t in model.state_dict().values())


@pytest.mark.parametrize("model_type, overrides", [("llama", LLAMA), ("qwen3_moe", MOE)], ids=["llama", "moe"])
def test_keeping_fp8_holds_a_byte_per_weight_where_dequantising_holds_four(tmp_path, model_type, overrides):
    """A llama of 4 layers, 512 wide (14M parameters in its projections: 54 MB in float32, 14 MB in
    fp8), and an MoE whose routed experts hold nearly all its weights: kept, the model holds each
    quantised weight in one byte, with its block scales, and nothing else of it (the bytes it holds are
    counted, not measured: the peak RSS of a load, a noisy figure, is benchmarks/load_memory.py --fp8's)."""
    make_tiny(model_type, tmp_path / "hf", overrides=overrides, std=0.02)
    quantized_checkpoint(tmp_path / "hf", tmp_path / "fp8")
    dense = zoo.from_pretrained(tmp_path / "fp8", fp8="dequantize", progress=False)
    kept = zoo.from_pretrained(tmp_path / "fp8", fp8="keep", progress=False)
    fp8 = {n: t for n, t in kept.state_dict().items() if t.dtype == torch.float8_e4m3fn}
    scales = {n: t for n, t in kept.state_dict().items() if n.endswith("_scale_inv")}
    quantised = sum(t.numel() for t in fp8.values())
    assert quantised > 0.9 * sum(p.numel() for p in dense.parameters())
    # What keeping saves is exactly three bytes per quantised weight, less the scales it holds beside them.
    assert held_bytes(dense) - held_bytes(kept) == 3 * quantised - sum(t.nbytes for t in scales.values())
    assert held_bytes(kept) < 0.3 * held_bytes(dense)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available() or not scaled_mm_supported(torch.device("cuda")),
                    reason="needs a GPU with block-scaled scaled_mm (compute capability 9.x)")
def test_block_scaled_scaled_mm_on_the_gpu():
    """On an H100/H200, a 256 x 384 FP8Linear takes scaled_mm (its first product checked against the
    dequantised one) and lands within what quantising its input to e4m3 makes of the product."""
    torch.manual_seed(0)
    m = FP8Linear(384, 256, bias=False, block=(128, 128), dtype=torch.bfloat16, device="cuda")
    w = torch.randn(256, 384, device="cuda")
    blocks = w.reshape(2, 128, 3, 128)
    scale = blocks.abs().amax(dim=(1, 3)) / 448.0
    m.weight.data = (blocks / scale[:, None, :, None]).to(torch.float8_e4m3fn).reshape(256, 384)
    m.weight_scale_inv.copy_(scale)
    x = torch.randn(3, 7, 384, device="cuda", dtype=torch.bfloat16)
    got = m(x).float()
    assert FP8Linear._checked[x.device] is True
    want = torch.nn.functional.linear(x.double(), m.dense_weight().double())
    assert (got - want).norm() / want.norm() < 2**-4


def test_zoo_verify_keeps_fp8(tmp_path, capsys):
    """``zoo verify --fp8 keep``: the kept model against transformers' dequantising load (block-aligned
    shapes, where transformers reads the block layout as zoo does; see test_fp8.py)."""
    from test_fp8 import WHOLE

    from zoo.cli import main

    make_tiny("llama", tmp_path / "hf", overrides=WHOLE, std=0.05)
    quantized_checkpoint(tmp_path / "hf", tmp_path / "fp8")
    assert main(["verify", str(tmp_path / "fp8"), "--fp8", "keep", "--seq-len", "16", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["passed"] is True


def test_zoo_generate_keeps_fp8(tmp_path, capsys):
    """``zoo generate --fp8 keep`` prints what the dequantised model generates (bytes tokenizer, vocabulary 256)."""
    from zoo.cli import main

    make_tiny("llama", tmp_path / "hf", overrides={"vocab_size": 256}, std=0.05)
    quantized_checkpoint(tmp_path / "hf", tmp_path / "fp8", block=32)
    assert main(["generate", str(tmp_path / "fp8"), "--prompt", "ab", "-n", "5", "--no-stop", "--tokenizer", "bytes",
                 "--fp8", "keep"]) == 0
    new = zoo.generate(zoo.from_pretrained(tmp_path / "fp8"), torch.tensor([list(b"ab")]), 5)[0, 2:]
    assert capsys.readouterr().out == "ab" + bytes(new.tolist()).decode("utf-8", "replace").rstrip("\ufffd") + "\n"


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available() or not scaled_mm_supported(torch.device("cuda")),
                    reason="needs a GPU with block-scaled scaled_mm (compute capability 9.x)")
def test_fp8_experts_take_block_scaled_scaled_mm_on_the_gpu():
    """On an H100/H200: 4 routed experts of 256 x 384 kept in FP8, each expert with tokens through
    scaled_mm, within what quantising the input to e4m3 makes of the float64 product (two products
    in a row, so 2 x 2^-4), and an expert without tokens skipped."""
    import torch.nn.functional as F

    from zoo.components.ffn.moe import GroupedExperts

    torch.manual_seed(0)
    like = GroupedExperts(4, 384, 256, gated=True, act=torch.nn.SiLU(), dispatch="loop")
    m = FP8Experts(like, block=(128, 128), dtype=torch.bfloat16, device="cuda")
    for name in m.projections():
        w = torch.randn(getattr(m, name).shape, device="cuda") * 0.05
        E, rows, cols = w.shape
        blocks = w.reshape(E, rows // 128, 128, cols // 128, 128)
        scale = blocks.abs().amax(dim=(2, 4)) / 448.0
        getattr(m, name).data = (blocks / scale[:, :, None, :, None]).to(torch.float8_e4m3fn).reshape(E, rows, cols)
        getattr(m, name + "_scale_inv").copy_(scale)
    counts = torch.tensor([5, 0, 3, 8], device="cuda")
    xs = torch.randn(16, 384, device="cuda", dtype=torch.bfloat16)
    got = m(xs, counts).double()
    dense = {n: m.dense_weight(n).double() for n in m.projections()}
    want = []
    for e, chunk in enumerate(xs.double().split(counts.tolist())):
        h = F.silu(chunk @ dense["w_gate"][e].T) * (chunk @ dense["w_up"][e].T)
        want.append(h @ dense["w_down"][e].T)
    want = torch.cat(want)
    assert FP8Linear._checked[xs.device] is True
    assert (got - want).norm() / want.norm() < 2 * 2**-4

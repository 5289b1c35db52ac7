"""A compiled training step traces in one graph: no host-device syncs or data-dependent Python
branches on the paths a step takes (each one would be a graph break, and a stall on a GPU), and
FlexAttention stays on inside torch.compile. Traced with ``torch._dynamo.explain`` on the CPU;
nothing is compiled, so this is quick."""

import pytest
import torch

import zoo
from zoo.core import kernels
from zoo.core import registry
import zoo.testing as zt
from kernel_refs import assert_compiles_as_eager
from zoo.testing import shrink

pytestmark = pytest.mark.slow  # torch.compile traces

FAMILIES = sorted(zoo.list_components("family"))


def breaks(fn, *args, where=False):
    torch._dynamo.reset()
    explained = torch._dynamo.explain(fn)(*args)
    if where:  # the file each break happened in
        return {b.user_stack[-1].filename.split("/")[-1] for b in explained.break_reasons}
    return [str(b.reason).splitlines()[0] for b in explained.break_reasons]


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    yield
    torch._dynamo.reset()


@pytest.mark.parametrize("name", FAMILIES)
def test_a_training_step_of_each_family_traces_without_graph_breaks(name, one_thread):
    fam = registry.get("family", name)
    full = fam.spec(next(iter(fam.presets)))
    kinds = [full.layer_kind(i) for i in range(full.n_layers)]
    spec = shrink(full, n_layers=max(2, *(kinds.index(k) + 1 for k in set(kinds))))  # every layer kind present
    model = zoo.build_model(spec, seed=0).train()
    ids = torch.randint(0, model.spec.vocab_size, (2, 9))  # longer than the shrunk windows (4)
    if any(layer.ffn.name == "moe" for layer in spec.layers.values()):
        # A mixture of experts sorts tokens by expert: how many each gets is data, so its dispatch
        # breaks the graph (docs/mechanisms/moe.md); nothing else may.
        assert breaks(lambda ids: model(ids, labels=ids).loss, ids, where=True) == {"moe.py"}
    else:
        assert breaks(lambda ids: model(ids, labels=ids).loss, ids) == []


def test_flex_attention_stays_on_and_traces_inside_torch_compile(monkeypatch, one_thread):
    from zoo.components.kernels import attention as flex

    model = zoo.build("gemma2-2b", n_layers=2, d_model=32, vocab_size=150, seed=0,
                      overrides={"layers.*.mixer.head_dim": 16, "layers.*.ffn.d_ff": 48,
                                 "layers.local.mixer.window": 4}).eval()
    ids = torch.randint(0, 150, (2, 9))
    ran = []
    real = flex.flex_attend
    monkeypatch.setattr(flex, "flex_attend", lambda *a, **k: ran.append(torch.compiler.is_compiling()) or real(*a, **k))
    kernels.refresh()  # a cold process: nothing imported yet but what configuring the setting loads
    with torch.no_grad(), kernels.using("attention:flex"):
        assert breaks(lambda ids: model(ids, labels=ids).loss, ids) == []
    assert ran and all(ran)  # both layers, while tracing
    kernels.refresh()


def _loss_model():
    return zoo.build("llama3-8b", n_layers=2, d_model=32, vocab_size=150, seed=0,
                     overrides={"layers.*.mixer.head_dim": 16, "layers.*.ffn.d_ff": 48, "z_loss": 1e-3})


@pytest.mark.parametrize("setting,module,attr,make", [
    ("loss:triton", "cross_entropy", "decoder_loss", _loss_model),
    ("scalar_decay:triton", "recurrent", "chunked",
     lambda: zt.tiny_model(zt.hybrid_spec("lightning_attention", {"n_heads": 2, "head_dim": 8, "chunk": 4})).train()),
    ("gated_delta:triton", "gated_deltanet", "chunk_gated_delta_rule",
     lambda: zt.tiny_model(zt.hybrid_spec("gated_deltanet", {"n_heads": 4, "n_key_heads": 2, "key_dim": 8,
                                                             "value_dim": 6, "chunk_size": 4})).train()),
], ids=["loss", "scalar_decay", "gated_delta"])
def test_triton_kernels_made_of_custom_operators_stay_on_inside_torch_compile(monkeypatch, one_thread, setting,
                                                                                module, attr, make):
    """The fused loss and the recurrent kernels are custom operators (forward and backward): under
    torch.compile they run as they are, a training step traces in one graph with them, and the
    compiled loss and every gradient equal the eager kernels' bit for bit (the same code runs)."""
    import importlib

    model = make()
    ids = torch.randint(0, model.spec.vocab_size, (2, 9))
    ran = []
    kernel = importlib.import_module(f"zoo.components.kernels.{module}")
    real = getattr(kernel, attr)
    monkeypatch.setattr(kernel, attr, lambda *a, **k: ran.append(torch.compiler.is_compiling()) or real(*a, **k))
    kernels.refresh()  # a cold process: the kernel's module is imported when the kernel registry is read
    with kernels.using(setting):
        assert_compiles_as_eager(lambda ids: model(ids, labels=ids).loss, ids, wrt=model.parameters())
    kernels.refresh()
    assert set(ran) == {True, False}  # the kernel was traced into the compiled graphs, and ran eagerly

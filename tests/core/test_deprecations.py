"""Every deprecated spelling in zoo.core.deprecations keeps working, and warns naming the new one.

Driven by the table itself (a new entry without an exercise here fails) and by an explicit list of
the import paths zoo 0.1 had (a module that moves without leaving a shim fails)."""

import importlib
import re
from dataclasses import dataclass

import pytest
import torch
from torch import nn

import zoo
import zoo.testing as zt
from zoo.core.deprecations import ALIASES, MOVED_MODULES, SINCE, removed_in, since

# zoo 0.1's module paths, each with names code written against it imports from there. Written out
# by hand, not read from the table.
OLD_IMPORTS = {
    "zoo.parts": ["PositionEncoding", "ForwardContext", "build_part"],
    "zoo.cache": ["DecodeState", "KVState"],
    "zoo.interfaces": ["Mixer", "Cost", "PositionEncoding", "PositionState", "ForwardContext", "build_part",
                       "rotary_dim_of"],
    "zoo.hookspecs": ["hookimpl", "zoo_register", "CONSTRUCTOR_CONTEXT", "module_interface", "check"],
    "zoo.registry": ["register", "get", "manager", "PluginManager", "RegistryError", "PluginError", "canonical_kind"],
    "zoo.spec": ["ModelSpec", "Part", "SpecError", "parse_part", "part_field", "apply_overrides"],
    "zoo.state": ["DecodeState", "KVState", "StaticKVState", "step_layout"],
    "zoo.kernels": ["Backend", "KIND"],
    "zoo.precision": [],
    "zoo.recipes": ["Family", "build", "get_spec", "list_models", "published_params"],
    "zoo.mtp": ["MTP", "MTPModule", "mtp_layer_kind", "MTPLayout", "DEEPSEEK", "mtp_rules", "read_mtp",
                "SpeculationStats", "speculative_generate"],
    "zoo.generation": ["generate", "length_limit"],
    "zoo.compiled": ["CompiledDecoder"],
    "zoo.tokenizer": ["Tokenizer"],
    "zoo.resume": ["step_of", "resume_point"],
    "zoo.data": ["TokenData", "get_tokenizer"],
    "zoo.ablate": [],
    "zoo.accounting": ["account"],
    "zoo.verification": ["verify"],
    "zoo.upcycling": ["upcycle"],
    "zoo.components.attention": ["Attention", "causal_mask", "dense_mask"],
    "zoo.components.mla": ["MLA"],
    "zoo.components.dsa": ["DSA"],
    "zoo.components.linear_attention": ["LinearAttention", "LightningAttention", "ScaledResidual"],
    "zoo.components.mamba2": ["Mamba2", "MixerOnly"],
    "zoo.components.gated_deltanet": ["GatedDeltaNet", "chunk_gated_delta_rule"],
    "zoo.components.recurrent": ["FixedState", "chunked", "step", "ShortConv", "GatedRMSNorm"],
    "zoo.components.masks": ["per_forward"],
    "zoo.components.ffn_only": ["NoMixer", "NoState", "FFNOnly"],
    "zoo.components.ffn": ["MLP", "SwiGLU", "derive_d_ff"],
    "zoo.components.moe": ["MoE", "Router", "SoftmaxTopK"],
    "zoo.components.positions": ["RoPE", "NoPE", "Learned"],
    "zoo.components.rope_scaling": ["YaRN", "Llama3", "default_inv_freq"],
    # zoo 0.2's training package, now zoo.training (zoo.train is the function)
    "zoo.train": ["TrainConfig", "Checkpointer"],
    "zoo.train.loop": ["train", "start_model"],
    "zoo.train.config": ["TrainConfig", "TrainResult"],
    "zoo.train.checkpointer": ["Checkpointer", "checkpoints", "read_checkpoint_state"],
    "zoo.train.data": ["TokenData", "get_tokenizer"],
    "zoo.train.resume": ["step_of", "resume_point"],
    "zoo.components.kernels.fit": ["recording", "compile_launch", "preset_problems"],
    # the checkpoints wing by concern (hf/: configs and names; files/: containers)
    **{f"zoo.checkpoints.{m}": [] for m in ("fields", "common", "sizes", "mtp", "formats")},
    "zoo.checkpoints.format": ["CheckpointFormat", "get_format"],
    "zoo.checkpoints.maps": ["bind", "IDENTITY"],
    **{f"zoo.checkpoints.formats.{m}": [] for m in (
        "_classic", "dbrx", "deepseek", "deepseek_moe", "deepseek_v32", "falcon", "glm_moe_dsa", "gpt2", "gpt_neox",
        "gptj", "mamba2", "minimax", "minimax_m2", "moe", "nemotron_h", "qwen3_next")},
    "zoo.checkpoints.formats.llama": ["LlamaStyle", "FORMATS"],
    **{f"zoo.checkpoints.{m}": [] for m in ("hub", "native", "gguf", "gguf_out")},
    "zoo.checkpoints.io": ["WeightFiles", "stream_shards"],
}

# zoo 0.1's zoo.training was a shim of zoo 0.2; it is the training package again, and hands over the
# same names without a warning.
TRAINING_0_1 = ["train", "TrainConfig", "TrainResult", "Checkpointer", "checkpoints", "read_checkpoint_state"]


def test_every_old_import_path_is_in_the_table():
    assert set(OLD_IMPORTS) == set(MOVED_MODULES)


@pytest.mark.parametrize("old", sorted(OLD_IMPORTS))
def test_an_old_import_path_hands_over_each_name_and_warns_naming_its_new_home(old):
    shim = importlib.import_module(old)
    names = OLD_IMPORTS[old] or [n for n in dir(shim)][:3]
    assert names, f"{old} hands over no names"
    for name in names:
        home = next(h for h in MOVED_MODULES[old] if hasattr(importlib.import_module(h), name))
        with pytest.warns(DeprecationWarning, match=rf"{re.escape(old)}\.{name} is deprecated since zoo {since(old)} and "
                                                    rf"will be removed in {removed_in(since(old))}: use {re.escape(home)}\.{name}$"):
            got = getattr(shim, name)
        assert got is getattr(importlib.import_module(home), name)


def test_an_unknown_name_of_an_old_module_says_where_it_moved():
    shim = importlib.import_module("zoo.resume")
    with pytest.raises(AttributeError, match="zoo.training.resume"):
        shim.no_such_name  # noqa: B018


def test_zoo_training_is_the_package_again_and_keeps_zoo_0_1_names(recwarn):
    import zoo.training as training
    from zoo.training import checkpointer, config, loop

    homes = (loop, config, checkpointer)
    for name in TRAINING_0_1:
        assert getattr(training, name) is next(getattr(m, name) for m in homes if hasattr(m, name))
    assert not [w for w in recwarn if issubclass(w.category, DeprecationWarning)]


def test_zoo_train_stays_the_function_after_its_old_submodules_are_imported():
    import zoo.train.loop  # noqa: F401  (zoo 0.2's path: a shim)

    assert callable(zoo.train) and zoo.train is importlib.import_module("zoo.training.loop").train
    with pytest.warns(DeprecationWarning, match=r"zoo\.train\.loop\.train is deprecated .* use zoo\.training\.loop\.train$"):
        from zoo.train.loop import train
    assert train is zoo.train


def test_old_module_paths_stay_reachable_as_attributes_of_zoo():
    with pytest.warns(DeprecationWarning, match="use zoo.core.registry.manager"):
        assert zoo.registry.manager() is zoo.manager()


# -- each alias of the table, exercised -----------------------------------------------------------

@dataclass(frozen=True)
class _Cfg:
    n_heads: int = 2


class OldMixer(nn.Module):
    """A mixer written before mixers: ``head_dim_for`` instead of ``rotary_dim``, registered by add_attention."""

    Config = _Cfg

    @staticmethod
    def head_dim_for(cfg, d_model):
        return d_model // cfg.n_heads

    def __init__(self, cfg, *, d_model, layer, spec, index=0):
        super().__init__()
        self.proj = nn.Linear(d_model, d_model)

    def forward(self, x, ctx, pos):
        return self.proj(x)


@dataclass(frozen=True)
class _NoCfg:
    pass


class CtxlessFFN(nn.Module):
    """An FFN written before FFNs got the forward context: ``forward(x)``."""

    Config = _NoCfg

    def __init__(self, cfg, *, d_model):
        super().__init__()
        self.lin = nn.Linear(d_model, d_model)

    def forward(self, x):
        return self.lin(x)


def _model():
    return zoo.build(zt.TINY, seed=0).eval()


def _ids():
    return torch.randint(0, 64, (1, 6), generator=torch.Generator().manual_seed(0))


def _kv_cache_for_model():
    model = _model()
    state = importlib.import_module("zoo.cache").KVCache.for_model(model)
    assert state.__class__.__name__ == "DecodeState"


def _rotary():
    from zoo.core.kinds import PositionState, Rotary

    assert Rotary is PositionState


def _q_idx():
    model = _model()
    ctx = model.context(_ids())
    assert ctx.q_idx is ctx.slots


def _hidden_states_in():
    model, ids = _model(), _ids()
    with torch.no_grad():
        torch.testing.assert_close(model.hidden_states_in(ids, model.context(ids)), model.run_layers(ids, model.context(ids)),
                                   rtol=0, atol=0)


def _cache_keyword():
    model, ids = _model(), _ids()
    with torch.no_grad():
        state = model.new_state(1, 16)
        steps = [model(ids[:, :4], cache=state), model(ids[:, 4:], cache=state)]
        torch.testing.assert_close(torch.cat(steps, 1), model(ids), atol=1e-5, rtol=1e-5)
    assert torch.equal(zoo.generate(model, ids, 3, cache=model.new_state(1, 16)), zoo.generate(model, ids, 3))


def _do_sample():
    model, ids = _model(), _ids()
    assert torch.equal(zoo.generate(model, ids, 4, do_sample=False, temperature=0.7), zoo.generate(model, ids, 4))


def _eos_token_id():
    model, ids = _model(), _ids()
    eos = int(zoo.generate(model, ids, 3)[0, -1])
    assert torch.equal(zoo.generate(model, ids, 3, eos_token_id=eos), zoo.generate(model, ids, 3, stop=eos))


def _streamer():
    model, ids = _model(), _ids()

    class Streamer:
        def __init__(self):
            self.put_, self.ended = [], False

        def put(self, column):
            self.put_.append(column)

        def end(self):
            self.ended = True

    streamer = Streamer()
    out = zoo.generate(model, ids, 3, streamer=streamer)
    assert streamer.ended and torch.equal(torch.stack(streamer.put_, 1), out[:, ids.shape[1]:])


def _add_attention():
    manager = zoo.manager()
    with manager.providing("old_plugin"):
        manager.add_attention("old_mixer", OldMixer, override=True)
    assert zoo.get("mixer", "old_mixer") is OldMixer


def _kind_attention():
    assert zoo.get("attention", "attention") is zoo.get("mixer", "attention")


def _spec_key_attention():
    spec = zoo.get_spec({**zt.TINY, "layers": {"default": {"attention": {"name": "attention", "n_heads": 2}}}})
    assert spec.layer(0).mixer.n_heads == 2
    assert zoo.get_spec(zt.TINY, {"layers.*.attention.n_heads": 2}).layer(0).mixer.n_heads == 2


def _layer_spec_attention():
    spec = zoo.get_spec(zt.TINY)
    assert spec.layer(0).attention is spec.layer(0).mixer


def _block_attention():
    for layer in _model().layers:
        assert layer.attention is layer.mixer


def _head_dim_for():
    manager = zoo.manager()
    with manager.providing("old_plugin"):
        manager.add_mixer("old_mixer", OldMixer, override=True)
    spec = zoo.get_spec({**zt.TINY, "layers": {"default": {"mixer": {"name": "old_mixer", "n_heads": 2}}}})
    assert zoo.build(spec, seed=0).positions["0"].dim == spec.d_model // 2  # RoPE sized by head_dim_for


def _ctxless_ffn():
    manager = zoo.manager()
    with manager.providing("old_plugin"):
        manager.add_ffn("ctxless", CtxlessFFN, override=True)
    model = zoo.build(zt.TINY, overrides={"layers.*.ffn": "ctxless"}, seed=0)
    assert model.loss(torch.randint(0, 64, (2, 8))).loss.isfinite()


def _kv_cache_key():
    from zoo.tools.accounting import account

    acc = account(zt.TINY)
    assert acc["kv_cache"] == acc["decode_state"]


def _decoder_generate():
    model, ids = _model(), _ids()
    assert torch.equal(model.generate(ids, 3), zoo.generate(model, ids, 3))


def _old_parameter_names():
    from zoo.checkpoints.hf.maps import bind, rule

    model = _model()
    bound = list(bind([rule("model.layers.{i}.self_attn.q_proj.weight", "layers.{i}.attention.q_proj.weight")], model))
    assert [b.zoo for b in bound] == [(f"layers.{i}.mixer.q_proj.weight",) for i in range(len(model.layers))]
    mtp = zoo.build(zt.TINY, overrides={"mtp": {"depth": 1}}, seed=0)
    bound = list(bind([rule("mtp.0.o_proj.weight", "mtp.layers.0.block.attention.o_proj.weight")], mtp))
    assert [b.zoo for b in bound] == [("mtp.layers.0.block.mixer.o_proj.weight",)]


def _moe_expert_attributes():
    moe = zoo.build_model(zt.one_of_each("qwen3-30b-a3b"), seed=0).layers[0].ffn
    assert moe.w_up is moe.experts.w_up


def _old_expert_names():
    from zoo.checkpoints.hf.maps import bind, rule

    model = zoo.build_model(zt.one_of_each("qwen3-30b-a3b"), seed=0)
    bound = list(bind([rule("model.layers.{i}.mlp.up", "layers.{i}.ffn.w_up")], model))
    assert [b.zoo for b in bound] == [(f"layers.{i}.ffn.experts.w_up",) for i in range(len(model.layers))]


def _llama_style_flags():
    from zoo.checkpoints.hf.formats.llama import TINY, LlamaStyle

    class OldStyle(LlamaStyle):  # a format written against zoo 0.2's class flags
        model_type = "old_style"
        qk_norm = "head"
        norm_extra = {"unit_offset": True}
        mlp_bias_key = None
        softcaps = True

    fmt = OldStyle()
    spec = fmt.config_to_spec({**TINY, "attn_logit_softcapping": 7.0})
    layer = spec.layer(0)
    assert (layer.mixer.qk_norm, layer.norm.unit_offset, spec.final_norm.unit_offset) == ("head", True, True)
    assert layer.mixer.softcap == 7.0
    cfg = fmt.spec_to_config(spec)
    assert "mlp_bias" not in cfg and cfg["attn_logit_softcapping"] == 7.0
    assert fmt.config_to_spec(cfg) == spec


EXERCISES = {
    "LlamaStyle class flags": _llama_style_flags,
    "zoo.cache.KVCache.for_model(model, max_len)": _kv_cache_for_model,
    "zoo.core.kinds.Rotary": _rotary,
    "ForwardContext.q_idx": _q_idx,
    "Decoder.hidden_states_in": _hidden_states_in,
    "Decoder.generate(...)": _decoder_generate,
    "the cache= keyword": _cache_keyword,
    "generate(do_sample=)": _do_sample,
    "generate(eos_token_id=)": _eos_token_id,
    "generate(streamer=)": _streamer,
    "PluginManager.add_attention": _add_attention,
    "kind 'attention'": _kind_attention,
    "spec key 'attention'": _spec_key_attention,
    "LayerSpec.attention": _layer_spec_attention,
    "a block's .attention": _block_attention,
    "Mixer.head_dim_for(cfg, d_model)": _head_dim_for,
    "an FFN whose forward takes no ctx": _ctxless_ffn,
    "accounting key 'kv_cache'": _kv_cache_key,
    "zoo-side parameter names layers.{i}.attention.*": _old_parameter_names,
    "zoo-side parameter names layers.{i}.ffn.w_gate, w_up, w_down (an moe FFN's experts)": _old_expert_names,
    "MoE.w_gate, MoE.w_up, MoE.w_down": _moe_expert_attributes,
}


def test_every_alias_of_the_table_is_exercised_here():
    assert set(EXERCISES) == set(ALIASES)


@pytest.mark.parametrize("old", sorted(ALIASES))
def test_an_old_spelling_still_works_and_warns_naming_the_new_one(old):
    with pytest.warns(DeprecationWarning, match=rf"^{re.escape(old)} is deprecated since zoo {since(old)} and will be "
                                                rf"removed in {removed_in(since(old))}: use {re.escape(ALIASES[old])}$"):
        EXERCISES[old]()


def test_the_new_spellings_do_not_warn(recwarn):
    import warnings

    warnings.simplefilter("error", DeprecationWarning)
    model, ids = _model(), _ids()
    spec = zoo.get_spec(zt.TINY, {"layers.*.mixer.n_heads": 2})
    with torch.no_grad():
        state = model.new_state(1, 16)
        model(ids[:, :4], state=state)
    zoo.generate(model, ids, 2)
    assert spec.layer(0).mixer.n_heads == 2 and "layers.0.mixer.q_proj.weight" in model.state_dict()


def test_a_name_deprecated_in_release_n_may_go_in_n_plus_2():
    assert (removed_in("0.2"), removed_in("0.3"), removed_in("1.9")) == ("0.4", "0.5", "1.11")
    assert since("zoo.train.loop") == "0.3" and since("zoo.spec") == since("spec key 'attention'") == "0.2"
    assert set(SINCE) <= set(ALIASES) | set(MOVED_MODULES)


def _warn_from(module: str) -> None:
    exec("import warnings\nwarnings.warn('an old name', DeprecationWarning, stacklevel=1)", {"__name__": module})


def test_the_suite_fails_on_our_deprecations_and_leaves_third_party_ones_to_them():
    """pyproject.toml's filterwarnings: a DeprecationWarning from zoo's code (or a test's) is an error;
    one raised within torch or transformers is shown, not failed."""
    import warnings

    with warnings.catch_warnings(record=True) as caught:  # the suite's filters, kept
        for ours in ("zoo.core.spec", "test_deprecations", "torchvisionish"):
            with pytest.raises(DeprecationWarning, match="an old name"):
                _warn_from(ours)
        _warn_from("transformers.modeling_utils")
        _warn_from("torch")
    assert len(caught) == 2


def test_no_package_binds_a_name_that_importing_an_old_module_path_would_rebind():
    """Importing the shim at an old path ``pkg.name`` sets ``pkg.name`` to the shim: a package whose
    own code reads a global of that name (``from zoo.checkpoints.files import gguf``) then calls the
    shim and warns, but only in a process that imported the old path first. Checked in a fresh
    interpreter, with every zoo module imported and no shim yet."""
    code = """if True:
        import importlib, pkgutil, sys, types
        import zoo
        from zoo.core.deprecations import MOVED_MODULES, _PACKAGES
        for info in pkgutil.walk_packages(zoo.__path__, "zoo."):
            if info.name not in MOVED_MODULES:
                importlib.import_module(info.name)
        assert not [m for m in MOVED_MODULES if m in sys.modules and m not in _PACKAGES and m != "zoo.train"]
        clashes = []
        for old in MOVED_MODULES:
            parent, _, name = old.rpartition(".")
            if old in _PACKAGES or old == "zoo.train" or parent not in sys.modules:
                continue  # a real package; the function zoo.train (its shim is put in place by hand)
            if name in vars(sys.modules[parent]):
                clashes.append(old)
        print(clashes)
    """
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "[]"

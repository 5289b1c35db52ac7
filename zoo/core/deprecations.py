"""The one table of deprecated spellings: every old name that still works, and what replaces it.

Modelled on timm's ``register_model_deprecations``: an old spelling keeps working for a stated
period and warns with a :class:`DeprecationWarning` that names the new one. A name deprecated in
release N warns and works through N+1 and may go in N+2 (CONTRIBUTING.md; CHANGELOG.md lists each):
what :data:`SINCE` does not date later was deprecated in zoo 0.2 and may go in 0.4.

- :data:`ALIASES`: old names of things (a class, an argument, a kind, a spec key...), each warned
  by :func:`warn` where the old spelling is read.
- :data:`MOVED_MODULES`: import paths that moved when zoo was grouped into wings (``zoo.core``,
  ``zoo.model``, ``zoo.inference``, ``zoo.checkpoints``, ``zoo.train``, ``zoo.tools``) and
  ``zoo/components/`` into folders by kind. No file is left at an old path: :func:`install` puts a finder
  on ``sys.meta_path`` that makes the old module on import, as a shim (:func:`moved_module`) that
  warns when a name is taken from it and hands over the name from its new home.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
import types
import warnings
from typing import Any, Callable, Optional

DEPRECATED_IN = "0.2"
REMOVED_IN = "0.4"


def removed_in(since: str) -> str:
    """The release that may remove a name deprecated in release ``since``: two minor releases on."""
    major, minor = since.split(".")[:2]
    return f"{major}.{int(minor) + 2}"

OLD_EXPERT_NAMES = "zoo-side parameter names layers.{i}.ffn.w_gate, w_up, w_down (an moe FFN's experts)"

#: old spelling -> new spelling
ALIASES: dict[str, str] = {
    "zoo.cache.KVCache.for_model(model, max_len)": "model.new_state(None, max_len)",
    "zoo.core.kinds.Rotary": "zoo.core.kinds.PositionState",
    "ForwardContext.q_idx": "ForwardContext.slots",
    "Decoder.hidden_states_in": "Decoder.run_layers",
    "Decoder.generate(...)": "zoo.generate(model, ...)",
    "the cache= keyword": "state=",
    "generate(do_sample=)": "temperature= (0: greedy), or Generation.from_transformers(do_sample=...) where "
                            "transformers' keywords come in",
    "generate(eos_token_id=)": "stop=",
    "generate(streamer=)": "callback=streamer.put (and streamer.end() after)",
    "PluginManager.add_attention": "PluginManager.add_mixer",
    "kind 'attention'": "kind 'mixer'",
    "spec key 'attention'": "spec key 'mixer' (layers.*.mixer.*)",
    "LayerSpec.attention": "LayerSpec.mixer",
    "a block's .attention": "the block's .mixer (layers.{i}.mixer)",
    "Mixer.head_dim_for(cfg, d_model)": "Mixer.rotary_dim(cfg, d_model)",
    "an FFN whose forward takes no ctx": "forward(self, x, ctx) (ctx may be None)",
    "accounting key 'kv_cache'": "accounting key 'decode_state'",
    "zoo-side parameter names layers.{i}.attention.*": "layers.{i}.mixer.*",
    OLD_EXPERT_NAMES: "layers.{i}.ffn.experts.w_*",
    "MoE.w_gate, MoE.w_up, MoE.w_down": "MoE.experts.w_gate, .w_up, .w_down (GroupedExperts)",
    "LlamaStyle class flags": "the format's fields, template, windows and ropes (docs/reference/checkpoints.md)",
}

#: deprecated calls whose new home is in a wing above the caller's -> "module:function" of the new home
#: (named, not imported, so the old spelling adds no arrow up the wing order)
MOVED_CALLS: dict[str, str] = {
    "Decoder.generate(...)": "zoo.inference.generate:generate",
}

#: old module -> the modules its names moved to (looked up in this order)
MOVED_MODULES: dict[str, tuple[str, ...]] = {
    "zoo.parts": ("zoo.core.kinds", "zoo.core.context", "zoo.core.spec"),
    "zoo.cache": ("zoo.core.state",),
    "zoo.interfaces": ("zoo.core.kinds", "zoo.core.context", "zoo.core.spec"),
    "zoo.hookspecs": ("zoo.core.hooks", "zoo.core.kinds"),
    "zoo.registry": ("zoo.core.registry", "zoo.core.plugins", "zoo.core.kinds"),
    "zoo.spec": ("zoo.core.spec",),
    "zoo.state": ("zoo.core.state",),
    "zoo.kernels": ("zoo.core.kernels",),
    "zoo.precision": ("zoo.core.precision",),
    "zoo.recipes": ("zoo.model.recipes", "zoo.core.spec"),
    "zoo.mtp": ("zoo.model.mtp", "zoo.checkpoints.hf.mtp", "zoo.inference.speculative"),
    "zoo.generation": ("zoo.inference.generate",),
    "zoo.compiled": ("zoo.inference.compiled",),
    "zoo.tokenizer": ("zoo.inference.tokenizer",),
    "zoo.resume": ("zoo.training.resume",),
    "zoo.data": ("zoo.training.data",),
    "zoo.ablate": ("zoo.tools.ablate",),
    "zoo.accounting": ("zoo.tools.accounting",),
    "zoo.verification": ("zoo.tools.verification",),
    "zoo.upcycling": ("zoo.tools.upcycling",),
    "zoo.components.attention": ("zoo.components.mixers.attention", "zoo.components.mixers._masks"),
    "zoo.components.mla": ("zoo.components.mixers.mla",),
    "zoo.components.dsa": ("zoo.components.mixers.dsa",),
    "zoo.components.linear_attention": ("zoo.components.mixers.linear_attention", "zoo.components.blocks"),
    "zoo.components.mamba2": ("zoo.components.mixers.mamba2", "zoo.components.blocks"),
    "zoo.components.gated_deltanet": ("zoo.components.mixers.gated_deltanet",),
    "zoo.components.recurrent": ("zoo.components.mixers._recurrent", "zoo.core.state"),
    "zoo.components.masks": ("zoo.components.mixers._masks",),
    "zoo.components.ffn_only": ("zoo.components.mixers.none", "zoo.core.state", "zoo.components.blocks"),
    "zoo.components.ffn": ("zoo.components.ffn.dense",),
    "zoo.components.moe": ("zoo.components.ffn.moe", "zoo.components.ffn.routers"),
    "zoo.components.positions": ("zoo.components.positions.encodings",),
    "zoo.components.rope_scaling": ("zoo.components.positions.rope_scaling",),
    # zoo 0.2's training modules (``zoo.train`` is the function; the package is ``zoo.training``)
    "zoo.train": ("zoo.training.loop", "zoo.training.config", "zoo.training.checkpointer"),
    "zoo.train.loop": ("zoo.training.loop",),
    "zoo.train.config": ("zoo.training.config",),
    "zoo.train.checkpointer": ("zoo.training.checkpointer",),
    "zoo.train.data": ("zoo.training.data",),
    "zoo.train.resume": ("zoo.training.resume",),
    # zoo 0.2's developer tool, out of the parts catalogue (``python -m zoo.tools.kernel_fit``)
    "zoo.components.kernels.fit": ("zoo.tools.kernel_fit",),
}
# The checkpoints wing by concern: HF configs and names in zoo.checkpoints.hf, file containers in
# zoo.checkpoints.files.
MOVED_MODULES.update({f"zoo.checkpoints.{m}": (f"zoo.checkpoints.hf.{m}",)
                      for m in ("format", "fields", "common", "sizes", "maps", "mtp", "formats")})
MOVED_MODULES.update({f"zoo.checkpoints.formats.{m}": (f"zoo.checkpoints.hf.formats.{m}",)
                      for m in ("_classic", "dbrx", "deepseek", "deepseek_moe", "deepseek_v32", "falcon", "glm_moe_dsa",
                                "gpt2", "gpt_neox", "gptj", "llama", "mamba2", "minimax", "minimax_m2", "moe",
                                "nemotron_h", "qwen3_next")})
MOVED_MODULES.update({f"zoo.checkpoints.{m}": (f"zoo.checkpoints.files.{m}",)
                      for m in ("io", "hub", "native", "gguf", "gguf_out")})

#: entries of :data:`ALIASES` and :data:`MOVED_MODULES` deprecated after zoo 0.2 -> the release that did:
#: spellings that were zoo 0.2's own (its blocks' ``attention``, its MoE's stacked ``w_up``, its Llama-style
#: class flags, its ``Decoder.generate``, training and checkpoints modules), which therefore work through 0.4
SINCE: dict[str, str] = {old: "0.3" for old in (
    "a block's .attention", "zoo-side parameter names layers.{i}.attention.*", "Decoder.generate(...)",
    OLD_EXPERT_NAMES, "MoE.w_gate, MoE.w_up, MoE.w_down", "LlamaStyle class flags",
    "zoo.train", "zoo.train.loop", "zoo.train.config", "zoo.train.checkpointer", "zoo.train.data", "zoo.train.resume",
    "zoo.components.kernels.fit", *(m for m in MOVED_MODULES if m.startswith("zoo.checkpoints.")),
    "generate(do_sample=)", "generate(eos_token_id=)", "generate(streamer=)")}


def since(old: str) -> str:
    """The release that deprecated ``old`` (a key of :data:`ALIASES` or :data:`MOVED_MODULES`)."""
    return SINCE.get(old, DEPRECATED_IN)


def message(old: str, new: str, deprecated_in: str = DEPRECATED_IN) -> str:
    return (f"{old} is deprecated since zoo {deprecated_in} and will be removed in {removed_in(deprecated_in)}: "
            f"use {new}")


def warn(old: str, *, stacklevel: int = 3) -> None:
    """Warn that the spelling ``old`` (a key of :data:`ALIASES`) was used, naming its replacement."""
    warnings.warn(message(old, ALIASES[old], since(old)), DeprecationWarning, stacklevel=stacklevel)


def moved_call(old: str, *, stacklevel: int = 3) -> Callable[..., Any]:
    """Warn that the call ``old`` (a key of :data:`MOVED_CALLS` and :data:`ALIASES`) was used, and
    return the function that replaces it."""
    warn(old, stacklevel=stacklevel + 1)
    module, name = MOVED_CALLS[old].split(":")
    return getattr(importlib.import_module(module), name)


def moved_module(old: str) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """``__getattr__`` and ``__dir__`` for the shim left at the old path ``old`` of a moved module."""
    homes = MOVED_MODULES[old]

    def names() -> list[str]:
        out: list[str] = []
        for home in homes:
            mod = importlib.import_module(home)
            out += [n for n in getattr(mod, "__all__", vars(mod)) if not n.startswith("_") and n not in out
                    and not isinstance(getattr(mod, n), types.ModuleType)]
        return out

    def __getattr__(name: str) -> Any:
        if name.startswith("__"):
            if name == "__all__":
                return names()
            raise AttributeError(name)
        for home in homes:
            mod = importlib.import_module(home)
            if hasattr(mod, name):
                warnings.warn(message(f"{old}.{name}", f"{home}.{name}", since(old)), DeprecationWarning, stacklevel=2)
                return getattr(mod, name)
        raise AttributeError(f"module {old!r} has no attribute {name!r} (it moved to {', '.join(homes)})")

    return __getattr__, names


class KVCache:
    """``zoo.cache.KVCache.for_model(model, max_len)``: the old spelling of ``model.new_state(None, max_len)``."""

    @staticmethod
    def for_model(model, max_len: Optional[int] = None):
        warn("zoo.cache.KVCache.for_model(model, max_len)")
        return model.new_state(None, max_len)


#: Names an old module held itself (not moved anywhere): the shim carries them.
_OWN: dict[str, dict[str, Any]] = {"zoo.cache": {"KVCache": KVCache}}


class _OldPaths(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Makes the shim of an old module path of :data:`MOVED_MODULES` when it is imported."""

    def find_spec(self, fullname: str, path: Any = None, target: Any = None):
        if fullname in MOVED_MODULES and fullname not in _PACKAGES:
            # an old package (zoo.checkpoints.formats) whose old submodules are shims of their own
            package = any(old.startswith(fullname + ".") for old in MOVED_MODULES)
            return importlib.util.spec_from_loader(fullname, self, is_package=package)
        return None

    def create_module(self, spec):
        return None

    def exec_module(self, module: types.ModuleType) -> None:
        old = module.__name__
        module.__doc__ = (f"Deprecated since zoo {since(old)}, removed in {removed_in(since(old))}: moved to "
                          f"{', '.join(MOVED_MODULES[old])}.")
        module.__getattr__, module.__dir__ = moved_module(old)
        vars(module).update(_OWN.get(old, {}))


# Old modules whose path is now a package (zoo/components/ffn/, zoo/components/positions/): the package's
# own ``__init__`` is their shim.
_PACKAGES = ("zoo.components.ffn", "zoo.components.positions")


def install() -> None:
    """Let the old module paths import (once per process; ``import zoo`` calls this)."""
    if not any(isinstance(f, _OldPaths) for f in sys.meta_path):
        sys.meta_path.append(_OldPaths())


def install_train_package() -> None:
    """``zoo.train`` is the function, and was also zoo 0.2's training package: its shim goes into
    ``sys.modules`` by hand (``import zoo`` calls this after binding the function), so that
    ``import zoo.train.loop`` finds a package there without rebinding ``zoo.train`` to a module."""
    if "zoo.train" not in sys.modules:
        shim = types.ModuleType("zoo.train")
        shim.__path__ = []  # a package: its old submodules are shims of their own
        shim.__spec__ = importlib.util.spec_from_loader("zoo.train", _OldPaths(), is_package=True)
        _OldPaths().exec_module(shim)
        sys.modules["zoo.train"] = shim

"""LoRA adapters on zoo models, through ``peft``: added for training, saved and loaded as PEFT
adapter directories (``adapter_config.json`` + ``adapter_model.safetensors``) under the Hugging Face
module names of the base model's checkpoint format, and merged into the base weights.

    >>> model = zoo.from_pretrained("HuggingFaceTB/SmolLM2-135M", adapter="runs/x/adapter")
    >>> zoo.merge_adapter(model)          # plain nn.Linear modules again, the update folded in
    >>> zoo.save_pretrained(model, "merged/")

peft wraps each targeted ``nn.Linear`` of the zoo model (``layers.0.mixer.q_proj``) in its own LoRA
layer; the names in the adapter file come from the format's weight-name map (``layers.{i}.mixer.q_proj.weight``
<-> ``model.layers.{i}.self_attn.q_proj.weight``), so ``peft.PeftModel.from_pretrained`` loads the
adapter onto the transformers model. A module whose weight the format stores through a transform
(a fused QKV, GPT-2's transposed Conv1D) has no PEFT adapter of the same shape: saving refuses it by
name, and the merged model is the way out.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Iterator, Optional, Sequence

import torch
from torch import nn

from zoo.checkpoints.hf.format import CheckpointError
from zoo.core.extras import import_extra

ADAPTER = "default"  # the one adapter zoo adds to a model
CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
PREFIX = "base_model.model."  # PEFT's prefix of the base model's module names in an adapter file
WRAPPED = "_checkpoint_wrapped_module."  # activation checkpointing's wrapper, not in any saved name
#: adapter_config.json fields zoo does not apply (refused when set), and what each asks for
REFUSED = {"use_dora": "DoRA", "modules_to_save": "a fully trained module", "rank_pattern": "a per-module rank",
           "alpha_pattern": "a per-module alpha", "fan_in_fan_out": "a transposed (Conv1D) weight",
           "lora_bias": "a LoRA bias", "target_parameters": "LoRA on bare parameters",
           "trainable_token_indices": "a trained token row", "layer_replication": "a replicated layer"}


def require_peft():
    return import_extra("peft", "LoRA adapters need", "train")


def lora_layers(model: nn.Module) -> dict[str, nn.Module]:
    """The model's LoRA-wrapped modules by their zoo name (``layers.0.mixer.q_proj``)."""
    try:
        from peft.tuners.lora import LoraLayer
    except ModuleNotFoundError:  # no peft: no adapter either
        return {}
    return {n.replace(WRAPPED, ""): m for n, m in model.named_modules() if isinstance(m, LoraLayer)}


def lora_targets(model: nn.Module, targets: Sequence[str] = (), *, exact: bool = False) -> list[str]:
    """The names of the ``nn.Linear`` modules ``targets`` pick, as peft matches them: a module whose
    name is a target or ends with ``.`` + a target (``q_proj`` picks every layer's,
    ``layers.0.mixer.q_proj`` one); ``exact``: only a module whose name is a target. No targets: every
    linear projection of the blocks (attention and MLP; not the head, the embedding or a multi-token
    prediction module). A target that picks nothing is an error naming it."""
    linears = [n for n, m in model.named_modules() if isinstance(m, nn.Linear)]
    if not targets:
        return [n for n in linears if n.replace(WRAPPED, "").startswith("layers.")]
    chosen = set()
    for t in targets:
        hits = [n for n in linears
                if n.replace(WRAPPED, "") == t or (not exact and n.replace(WRAPPED, "").endswith("." + t))]
        if not hits:
            leaves = sorted({n.rsplit(".", 1)[-1] for n in linears})
            raise ValueError(f"lora.targets: {t!r} names no linear module of the model; its linear modules are "
                             f"named {', '.join(leaves)} (or give a full name such as layers.0.mixer.q_proj)")
        chosen.update(hits)
    return [n for n in linears if n in chosen]


def add_lora(model: nn.Module, *, r: int = 16, alpha: float = 32, dropout: float = 0.0,
             targets: Sequence[str] = (), rslora: bool = False, seed: int = 0, exact: bool = False) -> nn.Module:
    """Wrap the linear modules ``targets`` picks (:func:`lora_targets`) with peft's LoRA layers of rank
    ``r`` (``exact``: ``targets`` are whole module names), scaled by ``alpha / r`` (``alpha / sqrt(r)``
    with ``rslora``), and freeze every other parameter: only the adapter trains. ``B`` starts at zero,
    so the model computes what it did; ``A`` is drawn by peft under the seed ``seed`` (the caller's
    random state is left as it was)."""
    peft = require_peft()
    if lora_layers(model):
        raise ValueError("the model already has a LoRA adapter; merge it first (zoo.merge_adapter)")
    names = lora_targets(model, targets, exact=exact)
    config = peft.LoraConfig(r=r, lora_alpha=alpha, lora_dropout=dropout, use_rslora=rslora, bias="none",
                             target_modules="^(" + "|".join(re.escape(n) for n in names) + ")$")
    training = model.training
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        peft.inject_adapter_in_model(config, model, adapter_name=ADAPTER)
    model.train(training)  # the new layers (their dropout) follow the model's mode: eval stays eval
    for p in model.parameters():
        p.requires_grad_(False)
    for layer in lora_layers(model).values():
        for p in [*layer.lora_A.parameters(), *layer.lora_B.parameters()]:
            p.requires_grad_(True)
    return model


def trainable(model: nn.Module) -> tuple[int, int]:
    """(trainable parameters, all parameters) of ``model``."""
    params = list(model.parameters())
    return sum(p.numel() for p in params if p.requires_grad), sum(p.numel() for p in params)


def merge_adapter(model: nn.Module) -> nn.Module:
    """Fold each LoRA layer's update into its base weight (peft's ``merge``, refusing a result that
    is not finite) and put the plain ``nn.Linear`` back in its place: the model computes what it
    computed with the adapter, and its weights carry zoo's names again. Returns ``model``."""
    layers = lora_layers(model)
    if not layers:
        raise ValueError("the model has no LoRA adapter to merge")
    for name, layer in [(n, m) for n, m in model.named_modules() if m in layers.values()]:
        with torch.no_grad():
            layer.merge(safe_merge=True)
        parent_name, _, leaf = name.rpartition(".")
        setattr(model.get_submodule(parent_name), leaf, layer.get_base_layer())
    if hasattr(model, "peft_config"):
        del model.peft_config
    return model


class MergedWeights(Mapping):
    """The weights of a model with a LoRA adapter (by its state dict's names: ``X.base_layer.weight``,
    ``X.lora_A.default.weight``, ``X.lora_B.default.weight``), read as the merged model's, by zoo's
    names: each adapted weight is merged when it is asked for, by peft's own ``merge`` on that one
    module, so an export streams a LoRA training checkpoint one tensor at a time as it does any other.
    ``weights`` is any such mapping (:class:`zoo.training.checkpointer.CheckpointWeights`); ``lora`` the
    run's settings (``r``, ``alpha``, ``rslora``); ``dtype`` casts floating tensors after the merge."""

    def __init__(self, weights: Mapping, lora: dict[str, Any], dtype: Optional[torch.dtype] = None):
        self.weights, self.lora, self.dtype = weights, lora, dtype
        self.base = {n.replace(".base_layer.", "."): n for n in weights if f".lora_A.{ADAPTER}." not in n
                     and f".lora_B.{ADAPTER}." not in n}

    def _cast(self, t: torch.Tensor) -> torch.Tensor:
        return t.to(self.dtype) if self.dtype is not None and t.is_floating_point() else t

    def meta(self, name: str) -> torch.Tensor:
        meta = getattr(self.weights, "meta", lambda n: self.weights[n].to("meta"))
        return self._cast(meta(self.base[name]))

    def __getitem__(self, name: str) -> torch.Tensor:
        stored = self.base[name]
        w = self.weights[stored]
        if not stored.endswith(".base_layer.weight"):
            return self._cast(w)
        module = stored[:-len(".base_layer.weight")]
        one = nn.Sequential(nn.Linear(w.shape[1], w.shape[0], bias=False, device="meta", dtype=w.dtype))
        add_lora(one, r=self.lora["r"], alpha=self.lora["alpha"], rslora=self.lora.get("rslora", False),
                 targets=("0",), exact=True)
        with torch.no_grad():
            one[0].get_base_layer().weight = nn.Parameter(w.clone(), requires_grad=False)
            for part in ("lora_A", "lora_B"):
                getattr(one[0], part)[ADAPTER].weight = nn.Parameter(self.weights[f"{module}.{part}.{ADAPTER}.weight"])
        try:
            merge_adapter(one)
        except ValueError as exc:
            raise ValueError(f"LoRA on {module}: {exc}") from None
        return self._cast(one[0].weight.detach())

    def __iter__(self) -> Iterator[str]:
        return iter(self.base)

    def __len__(self) -> int:
        return len(self.base)


def _module_map(model: nn.Module, model_type: str) -> dict[str, tuple[str, str]]:
    """zoo module -> (its HF module name, the transform its weight goes through) in ``model_type``'s
    format, for every module whose weight the format's map names."""
    from zoo.checkpoints.hf.format import get_format
    from zoo.checkpoints.hf.maps import bind
    from zoo.model.decoder import build_model

    plain = build_model(model.spec, device="meta")  # zoo's own names (no adapter), and the heads
    out = {}
    for b in bind(get_format(model_type).rules(model.spec), plain):
        for z in b.zoo:
            if z.endswith(".weight"):
                hf = b.hf[0] if len(b.hf) == 1 else ", ".join(b.hf)
                out[z[:-len(".weight")]] = (hf.removesuffix(".weight"), b.transform.name)
    return out


def hf_module_names(model: nn.Module, modules: Sequence[str], model_type: Optional[str],
                    mapped: Optional[dict[str, tuple[str, str]]] = None) -> dict[str, str]:
    """Each zoo module of ``modules`` -> its name in ``model_type``'s format (itself without a format),
    through ``mapped`` (the format's :func:`_module_map`, made when not given). A module whose weight
    the format stores through a transform (a fused QKV, a transposed Conv1D) or not at all is refused
    by name: no PEFT adapter for the transformers model holds its update."""
    if not model_type:
        return {z.replace(WRAPPED, ""): z.replace(WRAPPED, "") for z in modules}
    mapped = _module_map(model, model_type) if mapped is None else mapped
    names = {}
    for z in (m.replace(WRAPPED, "") for m in modules):
        hf, transform = mapped.get(z, (None, None))
        if hf is None or transform != "identity":
            how = f"stores its weight through {transform} (as {hf})" if hf else "has no name for it"
            raise CheckpointError(
                f"LoRA on {z}: the {model_type} format {how}, so a PEFT adapter for the transformers model "
                "cannot hold it; leave it out of lora.targets, or write the merged model instead "
                "(zoo.merge_adapter, then zoo.save_pretrained)")
        names[z] = hf
    return names


def _format_of(model: nn.Module, model_type: Optional[str]) -> Optional[str]:
    return model_type or getattr(model, "checkpoint_format", None)


def save_adapter(model: nn.Module, directory: str | Path, *, model_type: Optional[str] = None,
                 base: Optional[str] = None) -> Path:
    """Write the model's LoRA adapter as a PEFT adapter directory: ``adapter_config.json`` (peft's
    ``LoraConfig``, task ``CAUSAL_LM``, ``base`` as ``base_model_name_or_path``) and
    ``adapter_model.safetensors``, each module under its Hugging Face name in ``model_type``'s format
    (default: the format the model was loaded from), so that ``peft.PeftModel.from_pretrained`` loads
    it onto the transformers model. A model of no format is written under zoo's own module names,
    which :func:`load_adapter` reads. A module whose weight the format stores through a transform is
    refused by name."""
    from safetensors.torch import save_file

    peft = require_peft()
    layers = lora_layers(model)
    if not layers:
        raise ValueError("the model has no LoRA adapter to save; add one with zoo.checkpoints.adapter.add_lora "
                         "or train with lora settings")
    model_type = _format_of(model, model_type)
    mapped = _module_map(model, model_type) if model_type else {}
    names = hf_module_names(model, list(layers), model_type, mapped)
    every = {z: hf for z, (hf, _) in mapped.items()} if model_type else names
    first = next(iter(layers.values()))
    config = peft.LoraConfig(
        r=first.r[ADAPTER], lora_alpha=first.lora_alpha[ADAPTER], use_rslora=first.use_rslora[ADAPTER],
        lora_dropout=getattr(first.lora_dropout[ADAPTER], "p", 0.0), bias="none", task_type="CAUSAL_LM",
        target_modules=_target_list(names, every),
        base_model_name_or_path=None if base is None else str(base))
    tensors = {}
    for z, layer in layers.items():
        for part in ("lora_A", "lora_B"):
            weight = getattr(layer, part)[ADAPTER].weight
            tensors[f"{PREFIX}{names[z]}.{part}.weight"] = weight.detach().cpu().contiguous()
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(str(directory))
    save_file(tensors, str(directory / WEIGHTS_FILE), metadata={"format": "pt"})
    return directory


def _target_list(chosen: dict[str, str], every: dict[str, str]) -> list[str]:
    """``target_modules`` for the adapter's config, from the chosen zoo modules' HF names (``chosen``)
    and those of every module of the format's map (``every``): the leaf names (``q_proj``, ``v_proj``)
    when the adapter covers every module that has them, else the full module names."""
    leaves = {h.rsplit(".", 1)[-1] for h in chosen.values()}
    if {z for z, h in every.items() if h.rsplit(".", 1)[-1] in leaves} == set(chosen):
        return sorted(leaves)
    return sorted(chosen.values())


def load_adapter(model: nn.Module, directory: str | Path, *, model_type: Optional[str] = None) -> nn.Module:
    """Add the LoRA adapter in the PEFT adapter ``directory`` to ``model`` (a zoo model of the adapter's
    base), its module names read through ``model_type``'s format (default: the format the model was
    loaded from; zoo's own names are read too). What zoo does not apply (DoRA, ``modules_to_save``,
    trained biases, per-module ranks, an adapter type other than LoRA) is refused, naming the field;
    a tensor for no module of the model, or of the wrong shape, is refused naming the tensor."""
    from safetensors.torch import load_file

    directory = Path(directory)
    config_file = directory / CONFIG_FILE
    if not config_file.is_file():
        raise CheckpointError(f"{directory} is not a PEFT adapter directory: it has no {CONFIG_FILE}")
    try:
        cfg = json.loads(config_file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"{config_file}: not valid JSON ({exc})") from None
    for field, default, allowed in (("peft_type", "LORA", "LORA"), ("bias", "none", "none")):
        if cfg.get(field, default) != allowed:
            raise CheckpointError(f"{config_file}: {field} = {cfg[field]!r}: zoo applies LoRA adapters with "
                                  f"{field} = {allowed!r} only")
    for field, what in REFUSED.items():
        if cfg.get(field):
            raise CheckpointError(f"{config_file}: {field} = {cfg[field]!r}: {what} is not supported")
    weights_file = directory / WEIGHTS_FILE
    if not weights_file.is_file():
        raise CheckpointError(f"{directory} has no {WEIGHTS_FILE} (an adapter_model.bin is not read: "
                              "save the adapter with safe_serialization)")
    settings = adapter_settings(cfg, config_file)
    stored = load_file(str(weights_file))
    model_type = _format_of(model, model_type)
    to_zoo = {hf: z for z, (hf, t) in _module_map(model, model_type).items() if t == "identity"} if model_type else {}
    linears = {n.replace(WRAPPED, ""): m for n, m in model.named_modules() if isinstance(m, nn.Linear)}
    pattern = re.compile(r"^(?:" + re.escape(PREFIX) + r")?(.+)\.(lora_A|lora_B)(?:\.[^.]+)?\.weight$")
    found: dict[str, dict[str, torch.Tensor]] = {}
    for key, t in stored.items():
        m = pattern.match(key)
        module = m and (to_zoo.get(m.group(1)) or m.group(1))
        if not module or module not in linears:
            raise CheckpointError(f"{weights_file}: tensor {key!r} is for no linear module of this "
                                  f"{model_type or 'zoo'} model; the adapter was trained on another base")
        if not _targeted(settings["target_modules"], m.group(1)):
            raise CheckpointError(f"{weights_file}: tensor {key!r} is for {m.group(1)}, which {config_file.name}'s "
                                  f"target_modules {settings['target_modules']!r} does not name: PEFT would not apply "
                                  "it, so neither does zoo (add the module to target_modules, or drop the tensor)")
        found.setdefault(module, {})[m.group(2)] = t
    ranks = set()
    for module, parts in found.items():
        if set(parts) != {"lora_A", "lora_B"}:
            raise CheckpointError(f"{weights_file}: module {module} has {sorted(parts)} but needs lora_A and lora_B")
        a, b, base = parts["lora_A"], parts["lora_B"], linears[module]
        rank = a.shape[0] if a.ndim == 2 else "r"
        for part, t, want in (("lora_A", a, (rank, base.in_features)), ("lora_B", b, (base.out_features, rank))):
            if tuple(t.shape) != want:
                raise CheckpointError(f"{weights_file}: {module}.{part} is {tuple(t.shape)}, but on this model it "
                                      f"must be {want} (the rank from lora_A); the adapter is for another base")
        ranks.add(rank)
    if len(ranks) > 1:
        raise CheckpointError(f"{weights_file}: its lora_A tensors have ranks {sorted(ranks)}; zoo applies one rank "
                              "to every module (per-module ranks are rank_pattern's, which zoo does not read)")
    r = ranks.pop() if ranks else settings["r"]
    if r != settings["r"]:  # compared before peft allocates anything of rank r
        raise CheckpointError(f"{config_file}: r = {settings['r']}, but the lora_A tensors of {WEIGHTS_FILE} have "
                              f"rank {r}; the config does not describe these weights")
    add_lora(model, r=r, alpha=settings["lora_alpha"], dropout=settings["lora_dropout"], rslora=settings["use_rslora"],
             targets=sorted(found), exact=True)
    layers = lora_layers(model)
    with torch.no_grad():
        for module, parts in found.items():
            for part, t in parts.items():
                getattr(layers[module], part)[ADAPTER].weight.copy_(t)
    return model


def adapter_settings(cfg: dict, config_file: Path) -> dict[str, Any]:
    """The LoRA settings of an ``adapter_config.json``, each checked as PEFT's ``LoraConfig`` would
    have it (and with the defaults it has): ``r`` a positive integer, ``lora_alpha`` a positive finite
    number, ``lora_dropout`` in [0, 1), ``use_rslora`` a boolean, ``target_modules`` null, a regular
    expression or a list of module names. A wrong one is a CheckpointError naming the file and field."""
    import math

    def bad(field, must):
        return CheckpointError(f"{config_file}: {field} = {cfg[field]!r}: must be {must}")

    out = {"r": cfg.get("r", 8), "lora_alpha": cfg.get("lora_alpha", 8), "lora_dropout": cfg.get("lora_dropout", 0.0),
           "use_rslora": cfg.get("use_rslora", False), "target_modules": cfg.get("target_modules")}
    r = out["r"]
    if isinstance(r, bool) or not isinstance(r, int) or r < 1:
        raise bad("r", "a positive integer (the rank)")
    for field, ok, must in (
            ("lora_alpha", lambda v: math.isfinite(v) and v > 0, "a positive finite number"),
            ("lora_dropout", lambda v: 0 <= v < 1, "a number in [0, 1)")):
        v = out[field]
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not ok(v):
            raise bad(field, must)
    if not isinstance(out["use_rslora"], bool):
        raise bad("use_rslora", "true or false")
    targets = out["target_modules"]
    if isinstance(targets, str):
        try:
            re.compile(targets)
        except re.error as exc:
            raise bad("target_modules", f"a regular expression ({exc})") from None
    elif targets is not None and (not isinstance(targets, list) or not all(isinstance(t, str) and t for t in targets)):
        raise bad("target_modules", "a list of module names, or a regular expression")
    return out


def _targeted(targets, name: str) -> bool:
    """Whether PEFT's ``target_modules`` picks the module ``name``: a string is a regular expression the
    whole name must match, a list holds names the module's is or ends with (after a dot); none: the
    adapter's own tensors say (zoo's adapters from before ``target_modules`` was written)."""
    if targets is None:
        return True
    if isinstance(targets, str):
        return re.fullmatch(targets, name) is not None
    return any(name == t or name.endswith("." + t) for t in targets)

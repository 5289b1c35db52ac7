"""The model spec: a typed, nested, immutable, strict description of a decoder-only model.

A spec is a tree of frozen dataclasses. Every named part in it (a norm, an attention variant,
a position encoding...) is a :class:`Part`: the registered name plus that component's own
``Config`` dataclass. Parsing is strict: an unknown key, a wrong type or an impossible
combination raises :class:`SpecError` naming the exact path, e.g.
``layers.local.mixer.window``.
"""

from __future__ import annotations

import copy
import dataclasses
import fnmatch
import json
import math
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
import tomllib
from typing import TYPE_CHECKING, Any, Literal, Optional, Union

from zoo.core import deprecations as _deprecations
from zoo.core import registry as _registry

if TYPE_CHECKING:
    from torch import nn


class SpecError(ValueError):
    """An invalid spec. ``path`` is the dotted location of the fault."""

    def __init__(self, path: str, message: str):
        self.path, self.message = path, message
        super().__init__(f"{path or '<spec>'}: {message}")

    def under(self, prefix: str, note: str = "") -> "SpecError":
        """The same error seen from ``prefix`` (its path joined under it), with ``note`` appended."""
        path = f"{prefix}.{self.path}" if prefix and self.path else (prefix or self.path)
        return SpecError(path, self.message + note)


def part_field(kind: str, default: Any = dataclasses.MISSING, **kw: Any) -> Any:
    """A dataclass field holding a :class:`Part` of registry ``kind`` (a string default is fine)."""
    return field(default=default, metadata={"kind": kind}, **kw)


@dataclass(frozen=True)
class Part:
    """A registered component chosen by name, with its validated config."""

    kind: str
    name: str
    config: Any

    @property
    def cls(self) -> Any:
        return _registry.get(self.kind, self.name)

    def build(self, **context: Any) -> Any:
        return self.cls(self.config, **context)

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, **to_dict(self.config)}

    def __getattr__(self, item: str) -> Any:  # part.window reads the config's field
        if item.startswith("__"):
            raise AttributeError(item)
        return getattr(self.config, item)


# ---------------------------------------------------------------------------------------------
# Generic strict parsing of dataclasses from plain data (dicts, lists, scalars)
# ---------------------------------------------------------------------------------------------

def _join(path: str, key: Any) -> str:
    if isinstance(key, int):
        return f"{path}[{key}]"
    return f"{path}.{key}" if path else str(key)


def _type_name(tp: Any) -> str:
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


def parse_part(kind: str, data: Any, path: str) -> Part:
    kind = _registry.canonical_kind(kind)
    if isinstance(data, Part):
        if data.kind != kind:
            raise SpecError(path, f"expected a {kind}, got a {data.kind} ({data.name!r})")
        return data
    if isinstance(data, str):
        name, rest = data, {}
    elif isinstance(data, dict):
        if "name" not in data:
            raise SpecError(path, f"a {kind} needs a 'name' (one of: {', '.join(_registry.registry(kind).names())})")
        rest = dict(data)
        name = rest.pop("name")
        if not isinstance(name, str):
            raise SpecError(_join(path, "name"), f"expected a string, got {name!r}")
    else:
        raise SpecError(path, f"expected a {kind} name or a table with 'name', got {data!r}")
    try:
        name = _registry.registry(kind).resolve(name)  # a plugin's recipe: its own part of a shared name
        cls = _registry.get(kind, name)
    except _registry.UnknownNameError as exc:
        raise SpecError(_join(path, "name") if isinstance(data, dict) else path, str(exc)) from None
    return Part(kind, name, parse(cls.Config, rest, path))


def _parse_value(tp: Any, value: Any, path: str, kind: str | None) -> Any:
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if tp is Any:
        return value
    if origin in (Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        options = [a for a in args if a is not type(None)]
        errors = []
        for opt in options:
            try:
                return _parse_value(opt, value, path, kind)
            except SpecError as exc:
                errors.append(exc)
        if len(errors) == 1:
            raise errors[0]
        raise SpecError(path, f"expected {' or '.join(_type_name(o) for o in args)}, got {value!r}")
    if tp is Part:
        assert kind is not None, f"{path}: Part field without a kind"
        return parse_part(kind, value, path)
    if origin is Literal:
        if value not in args:
            raise SpecError(path, f"expected one of {', '.join(map(repr, args))}, got {value!r}")
        return value
    if tp is bool:
        if not isinstance(value, bool):
            raise SpecError(path, f"expected true or false, got {value!r}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise SpecError(path, f"expected an integer, got {value!r}")
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise SpecError(path, f"expected a number, got {value!r}")
        finite(path, value)
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise SpecError(path, f"expected a string, got {value!r}")
        return value
    if origin is tuple:
        if not isinstance(value, (list, tuple)):
            raise SpecError(path, f"expected a list, got {value!r}")
        item = args[0]
        return tuple(_parse_value(item, v, _join(path, i), kind) for i, v in enumerate(value))
    if origin is dict:
        if not isinstance(value, dict):
            raise SpecError(path, f"expected a table, got {value!r}")
        return {k: _parse_value(args[1], v, _join(path, k), kind) for k, v in value.items()}
    if dataclasses.is_dataclass(tp):
        return parse(tp, value, path)
    raise TypeError(f"{path}: unsupported field type {tp!r}")


def parse(cls: type, data: Any, path: str = "") -> Any:
    """Build dataclass ``cls`` from plain data, strictly. Errors name the exact path."""
    if isinstance(data, cls):
        return data
    if dataclasses.is_dataclass(data) and not isinstance(data, type):
        data = to_dict(data)
    if not isinstance(data, dict):
        raise SpecError(path, f"expected a table for {cls.__name__}, got {data!r}")
    for old, new in getattr(cls, "KEY_ALIASES", {}).items():
        if old in data:
            if new in data:
                raise SpecError(_join(path, old), f"{old!r} is the old name of {new!r}; give only one of them")
            _deprecations.warn(f"spec key {old!r}", stacklevel=4)
            data = {new if k == old else k: v for k, v in data.items()}
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    unknown = [k for k in data if k not in fields]
    if unknown:
        k = unknown[0]
        import difflib

        close = difflib.get_close_matches(str(k), list(fields), n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise SpecError(_join(path, k), f"unknown key {k!r}{hint}; {cls.__name__} accepts: {', '.join(fields)}")
    kwargs = {}
    for name, f in fields.items():
        fpath = _join(path, name)
        if name in data:
            kwargs[name] = _parse_value(hints[name], data[name], fpath, f.metadata.get("kind"))
        elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            raise SpecError(fpath, f"missing required key {name!r}")
        elif "kind" in f.metadata and isinstance(f.default, str):
            kwargs[name] = parse_part(f.metadata["kind"], f.default, fpath)
    try:
        obj = cls(**kwargs)
        check = getattr(obj, "check", None)
        if callable(check):
            check()
    except SpecError as exc:
        raise exc.under(path) from None
    return obj


def to_dict(obj: Any) -> Any:
    """Plain data (dicts, lists, scalars) for a spec or any part of it; ``None`` fields omitted."""
    if isinstance(obj, Part):
        return obj.to_dict()
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        out = {}
        for f in dataclasses.fields(obj):
            v = getattr(obj, f.name)
            if v is None:
                continue
            out[f.name] = to_dict(v)
        return out
    if isinstance(obj, dict):
        return {k: to_dict(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [to_dict(v) for v in obj]
    return obj


def finite(path: str, value: Any) -> None:
    """NaN and infinity are never a setting: refuse them naming the field."""
    if isinstance(value, float) and not math.isfinite(value):
        raise SpecError(path, f"must be a finite number, got {value!r}")


def differences(a: Any, b: Any, path: str = "") -> list[tuple[str, Any, Any]]:
    """Each dotted path where plain data ``a`` and ``b`` differ, with both values: tables key by key
    (a missing key counts as None), lists of equal length item by item."""
    if isinstance(a, dict) and isinstance(b, dict):
        return [d for k in sorted(set(a) | set(b), key=str) for d in differences(a.get(k), b.get(k), _join(path, k))]
    if isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        return [d for i, (x, y) in enumerate(zip(a, b)) for d in differences(x, y, f"{path}[{i}]")]
    return [] if a == b else [(path, a, b)]


def positive(path: str, value: Any, allow_none: bool = True) -> None:
    if value is None and allow_none:
        return
    if value is not None:
        finite(path, value)
    if value is None or value <= 0:
        raise SpecError(path, f"must be positive, got {value!r}")


# Upper bounds on a model's sizes, far beyond any published model, so that a typo
# (n_layers=10**9) is an error at once rather than minutes of building.
MAX_SIZES = {"vocab_size": 1 << 22, "d_model": 1 << 16, "n_layers": 1 << 12, "max_seq_len": 1 << 24}
MAX_HEAD_DIM = 1 << 16  # an attention head's width (RoPE's tables are computed on the CPU, even on meta)
MAX_MTP_DEPTH = 64  # multi-token prediction modules


def at_most(path: str, value: Optional[int], limit: int) -> None:
    if value is not None and value > limit:
        raise SpecError(path, f"{value} is beyond zoo's limit of {limit:,} (larger than any model it describes); "
                              "check the value")


def check_recipe_data(data: Any, path: str = "", depth: int = 0, seen: tuple[int, ...] = ()) -> None:
    """Refuse recipe data that contains itself or nests deeper than any spec, naming where."""
    if not isinstance(data, (dict, list, tuple)):
        return
    if id(data) in seen:
        raise SpecError(path, "the recipe contains itself here (a recursive recipe cannot describe a model)")
    if depth > 32:
        raise SpecError(path, "the recipe nests deeper than any spec (more than 32 levels)")
    items = data.items() if isinstance(data, dict) else enumerate(data)
    for k, v in items:
        check_recipe_data(v, _join(path, k), depth + 1, seen + (id(data),))


# ---------------------------------------------------------------------------------------------
# The model spec tree
# ---------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class EmbeddingSpec:
    """Token embeddings. ``scale``: multiply the embeddings by ``sqrt_d_model`` (Gemma) or by a number
    (``none``: by nothing). ``scale_dtype``: the dtype the factor is rounded to before it multiplies
    (``bfloat16``: RecurrentGemma's sqrt(2560) = 50.5); None rounds it to the activation dtype, as Gemma does."""

    scale: Union[Literal["none", "sqrt_d_model"], float] = "none"
    scale_dtype: Optional[Literal["float64", "float32", "bfloat16", "float16"]] = None
    # Rows beyond vocab_size (padding for hardware) are part of the matrix, not of the vocabulary.
    padded_vocab_size: Optional[int] = None

    def check(self) -> None:
        if not isinstance(self.scale, str):
            positive("scale", self.scale)
        if self.scale_dtype is not None and self.scale == "none":
            raise SpecError("scale_dtype", "rounds the embedding scale, but scale is 'none'")

    def factor(self, d_model: int) -> Optional[float]:
        """The number the embeddings are multiplied by (before rounding), or None."""
        if self.scale == "none":
            return None
        return math.sqrt(d_model) if self.scale == "sqrt_d_model" else self.scale


@dataclass(frozen=True)
class HeadSpec:
    """The LM head: tied to the embeddings or not, the logits multiplied by ``scale`` (Grok-1's output
    multiplier; None: by nothing), then an optional final-logit soft-cap."""

    tied: bool = False
    bias: bool = False
    scale: Optional[float] = None
    softcap: Optional[float] = None

    def check(self) -> None:
        positive("scale", self.scale)
        positive("softcap", self.softcap)


@dataclass(frozen=True)
class LayerSpec:
    """One kind of layer: its block wiring and the parts it is made of. ``mixer`` is the token
    mixer (attention is one kind; ``attention``, the old name of the key, is deprecated)."""

    KEY_ALIASES: typing.ClassVar[dict[str, str]] = {"attention": "mixer"}

    mixer: Part = part_field("mixer", "attention")
    ffn: Part = part_field("ffn", "swiglu")
    norm: Part = part_field("norm", "rmsnorm")
    block: Part = part_field("block", "serial")
    # Overrides the model-level position encoding for this kind of layer (Gemma 3's RoPE bases).
    position: Optional[Part] = part_field("position", None)

    @property
    def attention(self) -> Part:
        """The old name of :attr:`mixer` (deprecated)."""
        _deprecations.warn("LayerSpec.attention")
        return self.mixer


@dataclass(frozen=True)
class MTPSpec:
    """Multi-token prediction (DeepSeek-V3): ``depth`` extra modules, module d predicting token
    t+1+d from the hidden state of module d-1 (the main model's for d = 1) and the embedding of
    token t+d, through one block of layer kind ``layer`` (None: the last layer's kind), or through
    several blocks run in order when ``layer`` lists several kinds (Nemotron 3: attention, then MoE).
    Training adds ``weight / depth`` times each module's cross-entropy (DeepSeek's lambda / D)."""

    depth: int = 1
    weight: float = 0.3
    layer: Union[str, tuple[str, ...], None] = None

    def check(self) -> None:
        if self.depth < 1:
            raise SpecError("depth", f"must be at least 1 (leave out mtp for none), got {self.depth}")
        at_most("depth", self.depth, MAX_MTP_DEPTH)
        if self.weight < 0:
            raise SpecError("weight", f"must be >= 0, got {self.weight}")


@dataclass(frozen=True)
class ModelSpec:
    vocab_size: int
    d_model: int
    n_layers: int
    layers: dict[str, LayerSpec]
    # Layer i is of kind layer_pattern[i % len(layer_pattern)].
    layer_pattern: tuple[str, ...] = ("default",)
    max_seq_len: int = 2048
    position: Part = part_field("position", "rope")
    embedding: EmbeddingSpec = field(default_factory=EmbeddingSpec)
    final_norm: Optional[Part] = part_field("norm", None)
    head: HeadSpec = field(default_factory=HeadSpec)
    z_loss: float = 0.0
    dropout: float = 0.0
    init_std: float = 0.02
    label: Optional[str] = None
    mtp: Optional[MTPSpec] = None  # multi-token prediction modules (zoo/model/mtp.py)

    def check(self) -> None:
        for name in ("vocab_size", "d_model", "n_layers", "max_seq_len"):
            positive(name, getattr(self, name), allow_none=False)
            at_most(name, getattr(self, name), MAX_SIZES[name])
        at_most("embedding.padded_vocab_size", self.embedding.padded_vocab_size, MAX_SIZES["vocab_size"])
        if not self.init_std >= 0:
            raise SpecError("init_std", f"must be >= 0, got {self.init_std}")
        if not self.layers:
            raise SpecError("layers", "at least one kind of layer is needed")
        if not self.layer_pattern:
            raise SpecError("layer_pattern", "must name at least one layer kind")
        for i, kind in enumerate(self.layer_pattern):
            if kind not in self.layers:
                raise SpecError(f"layer_pattern[{i}]", f"{kind!r} is not a layer kind; kinds: {', '.join(self.layers)}")
        unused = [k for k in self.layers if k not in self.layer_pattern]
        if unused:
            raise SpecError(f"layers.{unused[0]}", "this layer kind never appears in layer_pattern")
        if not 0.0 <= self.dropout < 1.0:
            raise SpecError("dropout", f"must be in [0, 1), got {self.dropout}")
        if self.z_loss < 0:
            raise SpecError("z_loss", f"must be >= 0, got {self.z_loss}")
        if self.embedding.padded_vocab_size is not None and self.embedding.padded_vocab_size < self.vocab_size:
            raise SpecError("embedding.padded_vocab_size", "must be at least vocab_size")
        if self.mtp is not None and self.mtp.layer is not None:
            listed = isinstance(self.mtp.layer, tuple)
            if listed and not self.mtp.layer:
                raise SpecError("mtp.layer", "an empty list; name at least one layer kind (or leave it out)")
            for j, kind in enumerate(self.mtp.layer if listed else (self.mtp.layer,)):
                if kind not in self.layers:
                    raise SpecError(f"mtp.layer[{j}]" if listed else "mtp.layer",
                                    f"{kind!r} is not a layer kind; kinds: {', '.join(self.layers)}")
        # Cross-part checks: each part may declare `check_in(spec, layer_kind)` facts that need the model.
        for kind, layer in self.layers.items():
            for fname in ("mixer", "ffn", "norm", "block", "position"):
                part = getattr(layer, fname)
                if part is None:
                    continue
                if True:
                    try:
                        part.cls.check_in_model(part.config, spec=self, layer=layer)
                    except SpecError as exc:
                        raise exc.under(f"layers.{kind}.{fname}") from None
            pos = layer.position or self.position
            if True:
                where = f"layers.{kind}.position" if layer.position else "position"
                try:
                    pos.cls.check_in_model(pos.config, spec=self, layer=layer)
                except SpecError as exc:
                    raise exc.under(where) from None

        self.__dict__["sources"] = self._sources()  # resolved once, here: each read of it is a lookup

    def _sources(self) -> tuple[Optional[int], ...]:
        out = []
        for i in range(self.n_layers):
            mixer = self.layer(i).mixer
            try:
                out.append(mixer.cls.reads_from(mixer.config, spec=self, index=i))
            except SpecError as exc:
                raise exc.under(f"layers.{self.layer_kind(i)}.mixer") from None
        return tuple(out)

    @property
    def sources(self) -> tuple[Optional[int], ...]:
        """Per layer, the earlier layer whose output of the same forward its mixer reads (its mixer's
        ``reads_from``: DSA's shared indexer, the nearest full layer), or None; resolved when the spec is
        checked, so a mixer finds its source by its index instead of searching the spec."""
        return self.__dict__.get("sources") or self._sources()

    # -- convenience ----------------------------------------------------------------------------
    def layer_kind(self, i: int) -> str:
        return self.layer_pattern[i % len(self.layer_pattern)]

    def layer(self, i: int) -> LayerSpec:
        return self.layers[self.layer_kind(i)]

    def position_for(self, i: int) -> Part:
        return self.layer(i).position or self.position

    def to_dict(self) -> dict[str, Any]:
        return to_dict(self)

    def to_json(self, **kw: Any) -> str:
        return json.dumps(self.to_dict(), **{"indent": 2, **kw})

    def to_toml(self) -> str:
        import tomli_w

        return tomli_w.dumps(self.to_dict())

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "ModelSpec":
        check_recipe_data(data)
        return parse(cls, data)

    @classmethod
    def from_json(cls, text: str) -> "ModelSpec":
        return cls.from_dict(json.loads(text))

    @classmethod
    def from_toml(cls, text: str) -> "ModelSpec":
        import tomllib

        return cls.from_dict(tomllib.loads(text))

    @classmethod
    def from_file(cls, path: str | Path) -> "ModelSpec":
        path = Path(path)
        if path.is_dir():
            raise SpecError("", f"{path} is a directory, not a recipe file (.toml or .json)")
        text = path.read_text()
        try:
            if path.suffix == ".toml":
                return cls.from_toml(text)
            return cls.from_json(text)
        except SpecError as exc:
            raise exc.under("", f" (in {path})") from None
        except ValueError as exc:  # TOMLDecodeError and JSONDecodeError say the line and column
            raise SpecError("", f"{path} is not valid {'TOML' if path.suffix == '.toml' else 'JSON'}: {exc}") from None
        except RecursionError:
            raise SpecError("", f"{path} nests deeper than any spec") from None

    def with_overrides(self, overrides: dict[str, Any] | None = None, **kw: Any) -> "ModelSpec":
        """A new spec with dotted-path overrides applied (see :func:`apply_overrides`)."""
        return ModelSpec.from_dict(apply_overrides(self.to_dict(), {**(overrides or {}), **kw}))


# ---------------------------------------------------------------------------------------------
# Overrides: dotted paths into the plain-data form, with '*' matching any key
# ---------------------------------------------------------------------------------------------

# A key and its old name reach the same table, whichever of the two the data spells.
_PATH_ALIASES = {**LayerSpec.KEY_ALIASES, **{new: old for old, new in LayerSpec.KEY_ALIASES.items()}}


def apply_overrides(data: dict[str, Any], overrides: dict[str, Any]) -> dict[str, Any]:
    """Return a copy of ``data`` with each ``"a.b.c": value`` override set.

    ``n_layers=2`` sets a top-level key; ``"layers.local.mixer.window": 64`` one field of
    one part; ``"layers.*.mixer.n_heads": 4`` that field in every layer kind. Setting a
    part's ``name`` swaps the component (its other settings must then suit the new one).
    Keys may use ``__`` instead of ``.`` so they can be Python keyword arguments.
    """
    out = copy.deepcopy(data)
    for raw_key, value in overrides.items():
        key = raw_key.replace("__", ".")
        _set_path(out, key.split("."), value, key, "")
    return out


def _set_path(node: Any, parts: list[str], value: Any, full: str, here: str) -> None:
    head, rest = parts[0], parts[1:]
    if not isinstance(node, dict):
        raise SpecError(here, f"cannot apply override {full!r}: {here or 'the spec'} is not a table")
    if any(c in head for c in "*?["):
        keys = [k for k in node if fnmatch.fnmatchcase(k, head)]
        if not keys:
            raise SpecError(_join(here, head), f"override {full!r} matches nothing")
    elif head not in node and _PATH_ALIASES.get(head) in node:
        keys = [_PATH_ALIASES[head]]  # layers.*.mixer reaches layers.*.mixer, and back
        _deprecations.warn("spec key 'attention'", stacklevel=5)
    else:
        keys = [head]
    for k in keys:
        if not rest:
            node[k] = copy.deepcopy(value)
            continue
        child = node.get(k)
        if isinstance(child, str):  # a part given by name only: expand to a table
            child = node[k] = {"name": child}
        if child is None:
            child = node[k] = {}
        _set_path(child, rest, value, full, _join(here, k))


def build_part(part: Part | str, kind: str, **context: Any) -> nn.Module:
    """Build a part given as a :class:`Part` or a bare registered name (default config)."""
    if isinstance(part, str):
        from zoo.core.spec import parse_part

        part = parse_part(kind, part, kind)
    return part.build(**context)


PRESET_KEYS = {"set", "hf", "params", "description", "notes"}


def _extend(base: dict[str, Any], delta: dict[str, Any]) -> dict[str, Any]:
    """``base`` with ``delta`` laid over it table by table; a part table naming another ``name``
    replaces the base's part instead of merging into it."""
    out = copy.deepcopy(base)
    for key, value in delta.items():
        old = out.get(key)
        if isinstance(value, dict) and isinstance(old, dict) and value.get("name", old.get("name")) == old.get("name"):
            out[key] = _extend(old, value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def resolve_extends(data: dict[str, Any], where: str = "") -> dict[str, Any]:
    """Recipe data with every layer kind's ``extends = "other"`` replaced by the kind it extends plus
    its own delta (a part table of the same name merges field by field, one of another name replaces
    it); ``drop = ["mixer.window"]`` takes inherited settings off first. The spec itself never sees
    ``extends``. An unknown base, a cycle, or a kind whose block
    differs from its base's (extend the kind with the same block instead) is a SpecError naming the
    path."""
    layers = data.get("layers")
    if not isinstance(layers, dict) or not any(isinstance(v, dict) and "extends" in v for v in layers.values()):
        return data
    done: dict[str, dict[str, Any]] = {}

    def resolve(kind: str, chain: tuple[str, ...]) -> dict[str, Any]:
        if kind in done:
            return done[kind]
        table = layers[kind]
        if not isinstance(table, dict) or "extends" not in table:
            done[kind] = table
            return table
        path = _join(where, f"layers.{kind}.extends")
        parent = table["extends"]
        if not isinstance(parent, str):
            raise SpecError(path, f"must name a layer kind, got {parent!r}")
        if parent not in layers:
            raise SpecError(path, f"unknown layer kind {parent!r}; kinds: {', '.join(layers)}")
        if parent in chain:
            raise SpecError(path, f"layer kinds extend each other in a cycle: {' -> '.join((*chain, kind, parent))}")
        base = copy.deepcopy(resolve(parent, (*chain, kind)))
        delta = {k: v for k, v in table.items() if k not in ("extends", "drop")}
        drop = table.get("drop", [])
        if not isinstance(drop, list) or not all(isinstance(d, str) for d in drop):
            raise SpecError(_join(where, f"layers.{kind}.drop"), f"must be a list of dotted paths, got {drop!r}")
        for i, dotted in enumerate(drop):
            *parents, last = dotted.split(".")
            node = base
            for key in parents:
                node = node.get(key) if isinstance(node, dict) else None
            if not isinstance(node, dict) or last not in node:
                raise SpecError(_join(where, f"layers.{kind}.drop[{i}]"),
                                f"{dotted!r} is not set in layer kind {parent!r} that it extends")
            del node[last]
        block, base_block = delta.get("block"), base.get("block")
        name_of = lambda b: b.get("name") if isinstance(b, dict) else b  # noqa: E731
        if block is not None and name_of(block) != name_of(base_block):
            raise SpecError(_join(where, f"layers.{kind}.block"),
                            f"block {name_of(block)!r} differs from {name_of(base_block)!r} of layer kind {parent!r} "
                            "that it extends: extend a kind with the same block, or write the kind out in full")
        done[kind] = _extend(base, delta)
        return done[kind]

    return {**data, "layers": {kind: resolve(kind, ()) for kind in layers}}


@dataclass
class Family:
    name: str
    base: dict[str, Any]
    presets: dict[str, dict[str, Any]]
    description: str = ""
    source: str = ""
    reference: str = ""
    #: ``zoo`` or the plugin that registered the family (set at registration): its recipes resolve a
    #: part name that both zoo and that plugin register to the plugin's (zoo.core.registry.preferring)
    provider: str = ""

    def __post_init__(self) -> None:
        for preset, entry in self.presets.items():
            unknown = set(entry) - PRESET_KEYS
            if unknown:
                raise SpecError(f"presets.{preset}.{sorted(unknown)[0]}",
                                f"unknown preset key in family {self.name!r} ({self.source or 'python'}); "
                                f"allowed: {', '.join(sorted(PRESET_KEYS))}")

    def recipe(self, preset: str) -> dict[str, Any]:
        """The spec data of one preset: the base with the preset's overrides applied."""
        data = apply_overrides(resolve_extends(self.base), self.presets[preset].get("set", {}))
        data.setdefault("label", preset)
        return data

    def spec(self, preset: str) -> ModelSpec:
        try:
            with _registry.preferring(self.provider):
                return ModelSpec.from_dict(self.recipe(preset))
        except SpecError as exc:
            raise exc.under("", f" (preset {preset!r} of family {self.name!r}"
                                f"{', ' + self.source if self.source else ''})") from None

    def hf_ids(self, preset: str) -> list[str]:
        hf = self.presets[preset].get("hf", [])
        return [hf] if isinstance(hf, str) else list(hf)

    @classmethod
    def from_toml(cls, path: str | Path) -> "Family":
        path = Path(path)
        try:
            with open(path, "rb") as f:
                data = tomllib.load(f)
        except tomllib.TOMLDecodeError as exc:
            raise SpecError("", f"family file {path} is not valid TOML: {exc}") from None
        unknown = set(data) - {"family", "base", "presets"}
        if unknown:
            raise SpecError(sorted(unknown)[0], f"unknown top-level table in {path}; expected family, base, presets")
        meta = data.get("family", {})
        if "name" not in meta:
            raise SpecError("family.name", f"missing in {path}")
        return cls(
            name=meta["name"],
            base=data.get("base", {}),
            presets=data.get("presets", {}),
            description=meta.get("description", ""),
            reference=meta.get("reference", ""),
            source=str(path),
        )


# ``add_family(path)`` reads a TOML file with this, without the registry importing the spec.
_registry.FILE_READERS["family"] = Family.from_toml

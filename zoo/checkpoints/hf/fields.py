"""Field tables: HF config fields <-> spec fields, declared once and used in both directions.

A :class:`Field` ties one HF config key to one (or more) paths in the spec data, with the default
transformers' config class gives it and, where the two spell a value differently, a converter each
way. :func:`read_fields` reads a table through :class:`~zoo.checkpoints.hf.format.Fields` into spec data;
:func:`write_fields` writes the same table back from a spec. For the one-to-one fields the round
trip holds by construction, as it does for tensors through :class:`~zoo.checkpoints.hf.maps.Rule`.

A spec path is dotted (``d_model``, ``head.tied``, ``final_norm.eps``); one that starts with
``layer.`` names a field of the layer the format builds, before it decides the layer kinds (a window,
a sparse FFN) with its own readers. ``moe.`` and other top-level names a format invents are its own
scratch tables, taken off before parsing.

A table is a tuple of fields with ``+`` (add, or replace the field of the same HF key) and ``-``
(drop HF keys), so that a format states its difference from its parent's table and nothing else::

    QWEN2_FIELDS = LLAMA_FIELDS - ("attention_bias", "mlp_bias")
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Optional, Union

from zoo.core.spec import ModelSpec

REQUIRED = object()  # a Field default: absent or null is an error naming the key


@dataclass(frozen=True)
class Field:
    """One HF config key and where it lives in the spec.

    - ``spec``: the dotted spec path (or several, all given the value; written back from the
      first); None for a field that is read and typed but changes nothing zoo builds.
    - ``default``: the value when the key is absent or null (:data:`REQUIRED`: an error); a
      callable gets the HF values read so far (``{hf_key: value}``), for defaults such as
      ``head_dim = hidden_size // num_attention_heads``.
    - ``kind``: the JSON type the value must have (from the default when not given).
    - ``to_spec`` / ``to_hf``: the converters, when the two sides spell the value differently. A
      ``to_spec`` raising ValueError becomes an error naming the key.
    - ``source``: when writing, a function of the spec giving the value (a size a rule resolves,
      a count with a default), instead of the value at the spec path.
    - ``written``: False for a field only read (a legacy spelling whose meaning another field saves).
    """

    hf: str
    spec: Union[str, tuple[str, ...], None]
    default: Any = REQUIRED
    kind: Optional[type] = None
    to_spec: Optional[Callable[[Any], Any]] = None
    to_hf: Optional[Callable[[Any], Any]] = None
    source: Optional[Callable[[ModelSpec], Any]] = None
    written: bool = True

    @property
    def paths(self) -> tuple[str, ...]:
        return () if self.spec is None else (self.spec,) if isinstance(self.spec, str) else tuple(self.spec)


class FieldTable(tuple):
    """An ordered table of :class:`Field` s; ``+`` adds or replaces by HF key, ``-`` drops HF keys."""

    def __new__(cls, fields: Iterable[Field] = ()):
        return super().__new__(cls, fields)

    def __add__(self, other: Iterable[Field]) -> "FieldTable":
        other = list(other)
        keys = {f.hf for f in other}
        replaced = [next(o for o in other if o.hf == f.hf) if f.hf in keys else f for f in self]
        return FieldTable(replaced + [o for o in other if o.hf not in {f.hf for f in self}])

    def __sub__(self, keys: Union[str, Iterable[str]]) -> "FieldTable":
        keys = {keys} if isinstance(keys, str) else set(keys)
        unknown = keys - {f.hf for f in self}
        if unknown:
            raise KeyError(f"the table has no field {sorted(unknown)[0]!r}")
        return FieldTable(f for f in self if f.hf not in keys)

    def __getitem__(self, key):
        if isinstance(key, str):
            for f in self:
                if f.hf == key:
                    return f
            raise KeyError(key)
        return super().__getitem__(key)

    @property
    def paths(self) -> set[str]:
        """Every spec path the table stores."""
        return {p for f in self for p in f.paths}


def place(data: dict[str, Any], path: str, value: Any) -> None:
    """Set dotted ``path`` in nested ``data`` (making the tables on the way)."""
    *parents, last = path.split(".")
    for key in parents:
        data = data.setdefault(key, {})
    data[last] = value


def merged(base: dict[str, Any], delta: dict[str, Any]) -> dict[str, Any]:
    """``base`` with ``delta`` laid over it, table by table (a format's template over its parent's)."""
    out = copy.deepcopy(base)
    for key, value in delta.items():
        out[key] = merged(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


def read_fields(f, table: Iterable[Field], data: Optional[dict[str, Any]] = None) -> dict[str, Any]:
    """Read every field of ``table`` through ``f`` (a :class:`~zoo.checkpoints.hf.format.Fields`) into
    the spec data ``data`` (a new dict when None); returns it. ``f.values`` keeps the HF values read."""
    data = {} if data is None else data
    values = getattr(f, "values", None)
    if values is None:
        values = f.values = {}
    for field in table:
        default = field.default(values) if callable(field.default) else field.default
        if default is REQUIRED:
            value = f.require(field.hf, field.kind or int)
        else:
            value = f.get(field.hf, default, field.kind)
        values[field.hf] = value
        if field.to_spec is not None:
            try:
                value = field.to_spec(value)
            except ValueError as exc:
                raise f.error(field.hf, str(exc)) from None
        for path in field.paths:
            place(data, path, value)
    return data


def spec_value(spec: ModelSpec, path: str) -> Any:
    """The value at a spec path (``layer.`` is layer 0) of a parsed spec."""
    node: Any = spec
    for i, key in enumerate(path.split(".")):
        node = spec.layer(0) if (i == 0 and key == "layer") else getattr(node, key)
    return node


def write_fields(spec: ModelSpec, table: Iterable[Field], cfg: Optional[dict[str, Any]] = None) -> dict[str, Any]:
    """The HF config fields of ``table`` from ``spec`` (into ``cfg`` when given); returns them."""
    cfg = {} if cfg is None else cfg
    for field in table:
        if not field.written or (field.source is None and not field.paths):
            continue
        value = field.source(spec) if field.source is not None else spec_value(spec, field.paths[0])
        cfg[field.hf] = field.to_hf(value) if field.to_hf is not None else value
    return cfg


def expect(hf: str, allowed: Any, why: str = "") -> Field:
    """A field read only to refuse any value but ``allowed`` (absent counts as ``allowed[0]``), as
    :meth:`~zoo.checkpoints.hf.format.Fields.expect` does; nothing of it is written."""
    from zoo.checkpoints.hf.format import is_kind

    allowed = allowed if isinstance(allowed, (tuple, list)) else (allowed,)

    def check(value):
        if not any(value == a and (a is None or is_kind(value, type(a))) for a in allowed):
            raise ValueError(f"value {value!r} is not supported{': ' + why if why else ''}")
        return value

    return Field(hf, None, allowed[0], to_spec=check)


def known(*keys: str) -> list[Field]:
    """Fields read (so not listed as ignored) that change nothing zoo builds, or that a format's own
    reader interprets."""
    return [Field(k, None, None) for k in keys]


#: The spec's top-level sizes a table may store or leave out (see :attr:`TableFormat.not_stored`).
STORED_AT_TOP = ("vocab_size", "d_model", "n_layers", "max_seq_len")


def _format_base():
    from zoo.checkpoints.hf.format import CheckpointFormat

    return CheckpointFormat


class TableFormat(_format_base()):
    """A checkpoint format declared as a field table over a template.

    ``config_to_spec`` reads :attr:`fields` over a copy of :attr:`template`, lets :meth:`complete`
    turn the ``layer`` table into layer kinds (one ``default`` kind unless a subclass reads more:
    windows, layer types, RoPE), and parses; ``spec_to_config`` writes the same table back, and a
    subclass adds what its readers wrote.
    """

    fields: FieldTable = FieldTable()
    template: dict[str, Any] = {}

    @property
    def not_stored(self) -> tuple[str, ...]:
        """The spec's top-level sizes the table has no field for: a format without
        ``max_position_embeddings`` does not store ``max_seq_len``."""
        return tuple(p for p in STORED_AT_TOP if p not in FieldTable(self.fields).paths)

    def read_table(self) -> FieldTable:
        """The fields ``config_to_spec`` reads (:attr:`fields`, and any read only)."""
        return FieldTable(self.fields)

    def complete(self, f, data: dict[str, Any]) -> None:
        """Turn the spec data read from the table into the whole spec (in place)."""
        data["layers"] = {"default": data.pop("layer")}

    def config_to_spec(self, config, *, strict=False):
        from zoo.checkpoints.hf.format import Fields

        f = Fields(config, self.model_type, self.defaults)
        data = read_fields(f, self.read_table(), copy.deepcopy(self.template))
        self.complete(f, data)
        f.finish(strict)
        return ModelSpec.from_dict(data)

    def spec_to_config(self, spec):
        return write_fields(spec, self.fields)

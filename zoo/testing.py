"""Conformance checks for registered parts: the contract every part of a kind must honour.

The built-in parts and plugin parts pass the same checks. A plugin's test suite needs one line::

    zoo.testing.check_plugin("my_plugin")          # every part the plugin registered
    zoo.testing.check("norm", "dyt", {"alpha_init": 1.0})  # one part, with a config

Each kind's contract checks shapes, dtypes (float32 and bfloat16), gradients, building on the
meta device, and what the kind must do: a norm bounds its output whatever the input's scale,
an activation is pointwise, an FFN mixes no tokens, a relative position encoding makes
scores depend only on the distance between positions, a RoPE scaling only slows rotations down,
mixers and blocks are causal and handle padding. Each part is also checked inside a tiny model
(forward, backward, causality, left padding, and incremental decoding against the full forward,
always: prefill then single tokens, several tokens onto an existing state, a left-padded batch,
past a window, and the static state of compiled decoding); a mixer is also checked beside
standard attention in one hybrid model.
Helpers such as :func:`tiny_model`, :func:`attention_inputs` and :func:`qk_scores` are public so
plugin tests can state their part's own numeric properties.
"""

from __future__ import annotations

import contextlib
import copy
import inspect
import math
from typing import Any, Callable, Optional

import torch

from zoo.core import kinds as _kinds
from zoo.core import registry as _registry
from zoo.core.context import ForwardContext
from zoo.core.kinds import PositionState, rotary_dim_of
from zoo.core.spec import ModelSpec, Part, apply_overrides, parse_part

#: The tiny model every part is checked in: 2 layers, d_model 32, 4 query heads of 8, 2 kv heads.
TINY: dict[str, Any] = {
    "vocab_size": 64,
    "d_model": 32,
    "n_layers": 2,
    "max_seq_len": 64,
    "position": {"name": "rope"},
    "final_norm": {"name": "rmsnorm"},
    "layers": {"default": {"mixer": {"name": "attention", "n_heads": 4, "n_kv_heads": 2}, "ffn": {"name": "glu"}}},
}
#: Where a part of each kind goes in the tiny model.
SLOTS: dict[str, tuple[str, ...]] = {
    "norm": ("layers.default.norm", "final_norm"),
    "activation": ("layers.default.ffn.activation",),
    "ffn": ("layers.default.ffn",),
    "position": ("position",),
    "rope_scaling": ("position.scaling",),
    "mixer": ("layers.default.mixer",),
    "block": ("layers.default.block",),
}
#: Settings a kind's config usually requires, filled in when a check is given no config.
KIND_DEFAULTS: dict[str, dict[str, Any]] = {"mixer": {"n_heads": 4, "n_kv_heads": 2}}

CONTRACTS: dict[str, Callable[..., None]] = {}


def contract(kind: str):
    """Declare the conformance contract of a kind: ``fn(kind, name, config)`` raising AssertionError."""

    def deco(fn):
        CONTRACTS[kind] = fn
        return fn

    return deco


# ---------------------------------------------------------------------------------------------
# Entry points
# ---------------------------------------------------------------------------------------------

def check(kind: str, name: str, config: Optional[dict[str, Any]] = None) -> None:
    """Run the contract of ``kind`` on the registered part ``name`` with ``config`` (plain data)."""
    kind = _registry.canonical_kind(kind)
    fn = CONTRACTS.get(kind)
    assert fn is not None, (
        f"no conformance contract for kind {kind!r} (contracts: {', '.join(CONTRACTS)}); "
        "declare one with @zoo.testing.contract(kind)"
    )
    config = default_config(kind, name) if config is None else dict(config)
    if kind in SLOTS:  # first, so that a part left uninitialised is named, not met as garbage by the checks
        assert_initialised(tiny_spec_with(kind, name, config), f"{kind} {name!r} {config}")
    fn(kind, name, config)


def check_plugin(plugin: str, configs: Optional[dict[tuple[str, str], list[dict[str, Any]]]] = None) -> list[tuple[str, str]]:
    """Check every part ``plugin`` registered (``configs`` maps ``(kind, name)`` to the configs to
    try; default: the part's default config). Returns what was checked."""
    info = _registry.manager().load_plugin(plugin)
    assert info.error is None, f"plugin {plugin!r} failed to load: {info.error}"
    assert info.registered, f"plugin {plugin!r} registered nothing"
    for kind, name in info.registered:
        for cfg in (configs or {}).get((kind, name), [None]):
            check(kind, name, cfg)
    return list(info.registered)


def default_config(kind: str, name: str) -> dict[str, Any]:
    """The config data a check uses when given none: the kind's usual required settings (only
    those the part's Config has and needs)."""
    kind = _registry.canonical_kind(kind)
    if kind not in SLOTS:
        return {}
    cls = _registry.get(kind, name)
    fields = {p.name: p for p in inspect.signature(cls.Config).parameters.values()}
    return {k: v for k, v in KIND_DEFAULTS.get(kind, {}).items() if k in fields}


def part(kind: str, name: str, config: Optional[dict[str, Any]] = None) -> Part:
    """The registered part ``name`` of ``kind`` with ``config`` (its settings, parsed strictly), ready
    to ``.build(...)`` with the context of its kind: ``part("norm", "dyt", {"alpha_init": 1.0}).build(dim=64)``."""
    return parse_part(kind, {"name": name, **(config or {})}, kind)


def tiny_spec(overrides: Optional[dict[str, Any]] = None, **kw: Any) -> ModelSpec:
    """The tiny spec, with dotted-path overrides (``{"layers.default.mixer.window": 4}``)."""
    return ModelSpec.from_dict(apply_overrides(copy.deepcopy(TINY), {**(overrides or {}), **kw}))


def tiny_spec_with(kind: str, name: str, config: Optional[dict[str, Any]] = None, **overrides: Any) -> ModelSpec:
    """The tiny spec with part ``name`` of ``kind`` in every slot of its kind."""
    data = {"name": name, **(config or {})}
    return tiny_spec({**{slot: data for slot in SLOTS[_registry.canonical_kind(kind)]}, **overrides})


def hybrid_spec(name: str, config: Optional[dict[str, Any]] = None, **overrides: Any) -> ModelSpec:
    """The tiny spec with two layer kinds: mixer ``name`` first, then standard attention (the
    layout of a hybrid such as Jamba or Gemma 3's local/global mix)."""
    data = copy.deepcopy(TINY)
    data["layers"] = {"part": {**data["layers"]["default"], "mixer": {"name": name, **(config or {})}},
                      "attention": data["layers"]["default"]}
    data["layer_pattern"] = ["part", "attention"]
    return ModelSpec.from_dict(apply_overrides(data, overrides))


def tiny_model(spec: ModelSpec | dict[str, Any] | None = None, *, dtype: Optional[torch.dtype] = None, seed: int = 0):
    """A built, seeded model of ``spec`` (default :data:`TINY`; a dict is a set of dotted-path overrides
    of it, as in :func:`tiny_spec`), in eval mode, with the norms' 1-D parameters moved off their
    initial values so that a norm initialised as an identity still shows in the output. Put a part in it with
    ``tiny_model(tiny_spec_with("norm", "dyt"))``."""
    from zoo.model.decoder import build_model

    if spec is None or isinstance(spec, dict):
        spec = tiny_spec(spec)
    model = build_model(spec, dtype=dtype, seed=seed)
    with torch.no_grad():  # parts initialised as identities (zero offsets) get a non-trivial value
        gen = torch.Generator().manual_seed(seed + 1)
        for name, p in model.named_parameters():
            if p.ndim == 1 and "norm" in name:
                p.add_(0.1 * torch.randn(p.shape, generator=gen).to(p.dtype))
    return model.eval()


# ---------------------------------------------------------------------------------------------
# Assertions shared by the contracts (and usable by plugin tests)
# ---------------------------------------------------------------------------------------------

def _close(a: torch.Tensor, b: torch.Tensor, what: str, atol: float = 1e-5, rtol: float = 1e-5) -> None:
    assert a.shape == b.shape, f"{what}: shapes differ, {tuple(a.shape)} vs {tuple(b.shape)}"
    err = (a.float() - b.float()).abs().max().item() if a.numel() else 0.0
    assert torch.allclose(a.float(), b.float(), atol=atol, rtol=rtol), f"{what}: max abs difference {err:.3g}"


def _finite(t: torch.Tensor, what: str) -> None:
    assert torch.isfinite(t).all(), f"{what}: non-finite values"


def assert_grads(module: torch.nn.Module, out: torch.Tensor, inputs: tuple[torch.Tensor, ...] = (), what: str = "",
                 aux: Optional[torch.Tensor] = None) -> None:
    """Backward from ``out`` (plus ``aux``, the auxiliary losses the part added) reaches every
    trainable parameter and input, with finite values."""
    (out.float().pow(2).mean() + (aux if aux is not None else 0.0)).backward()
    for n, p in module.named_parameters():
        if p.requires_grad:
            assert p.grad is not None, f"{what}: parameter {n!r} gets no gradient"
            _finite(p.grad, f"{what}: gradient of {n!r}")
    for i, x in enumerate(inputs):
        assert x.grad is not None and torch.isfinite(x.grad).all(), f"{what}: input {i} gets no finite gradient"
        assert x.grad.abs().sum() > 0, f"{what}: input {i} gets an all-zero gradient"


def assert_builds_on_meta(build: Callable[[], torch.nn.Module], what: str) -> None:
    with torch.device("meta"):
        module = build()
    for n, t in list(module.named_parameters()) + list(module.named_buffers()):
        assert t.device.type == "meta", f"{what}: {n!r} was allocated on {t.device} when building on meta"


def assert_causal(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, t: int, perturb: Callable[[torch.Tensor], torch.Tensor], what: str) -> None:
    """Changing position ``t`` of the input leaves outputs before ``t`` unchanged and changes ``t``."""
    y = fn(x)
    y2 = fn(perturb(x))
    _close(y2[:, :t], y[:, :t], f"{what}: a change at position {t} altered earlier outputs")
    assert not torch.allclose(y2[:, t], y[:, t]), f"{what}: a change at position {t} did not reach its own output"


def attention_inputs(spec: ModelSpec, B: int = 2, T: int = 10, layer: int = 0, dtype=torch.float32, seed: int = 0):
    """(x, ctx, pos) to call layer ``layer``'s mixer or block of ``spec`` directly (``pos`` is None
    when the mixer takes no rotation and the position encoding would rotate)."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(B, T, spec.d_model, generator=gen).to(dtype)
    pos_ids = torch.arange(T).expand(B, T)
    ctx = ForwardContext(position_ids=pos_ids, slots=torch.arange(T))
    part = spec.position_for(layer)
    if part.cls.applies_to == "qk" and rotary_dim_of(spec.layer(layer), spec.d_model) is None:
        return x, ctx, None
    pos = part.build(spec=spec, layer=spec.layer(layer))
    if isinstance(pos, torch.nn.Module):
        pos = pos.to(dtype)
    return x, ctx, PositionState(pos, pos.prepare(pos_ids, dtype))


def qk_scores(pos, q: torch.Tensor, k: torch.Tensor, m: int, n: int) -> torch.Tensor:
    """Score of query ``q`` at position ``m`` against key ``k`` at ``n`` after position encoding
    ``pos`` (q, k: (1, H, 1, D)): rotations for ``qk`` encodings plus the bias for ``bias`` ones."""
    qm, _ = pos.rotate(q, q, pos.prepare(torch.tensor([[m]]), q.dtype))
    _, kn = pos.rotate(k, k, pos.prepare(torch.tensor([[n]]), k.dtype))
    s = (qm * kn).sum(-1)[..., None]  # (1, H, 1, 1)
    state = pos.prepare(torch.tensor([[m, n]]), q.dtype)
    bias = pos.score_bias(state, torch.tensor([m]), torch.tensor([n]), q.shape[1])
    return s if bias is None else s + bias


# ---------------------------------------------------------------------------------------------
# The contracts
# ---------------------------------------------------------------------------------------------

def _dtypes_ok(fn: Callable[[torch.dtype], torch.Tensor], what: str) -> None:
    for dtype in (torch.float32, torch.bfloat16):
        y = fn(dtype)
        assert y.dtype == dtype, f"{what}: {dtype} input gave a {y.dtype} output"
        _finite(y, f"{what} in {dtype}")


@contextlib.contextmanager
def fresh_memory_nan():
    """Inside: memory torch allocates without filling it (``torch.empty``) holds NaN (integers their
    largest value), through torch's deterministic mode, so a parameter nothing initialises shows."""
    was = (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled(),
           torch.utils.deterministic.fill_uninitialized_memory)
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.utils.deterministic.fill_uninitialized_memory = True
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(was[0], warn_only=was[1])
        torch.utils.deterministic.fill_uninitialized_memory = was[2]


def assert_initialised(spec: ModelSpec, what: str) -> None:
    """Every parameter of a tiny model of ``spec`` is initialised: built with fresh memory filled with
    NaN (:func:`fresh_memory_nan`), none is left holding it after the model's ``init_weights``."""
    with fresh_memory_nan():
        model = tiny_model(spec)
    for n, p in model.named_parameters():
        assert torch.isfinite(p).all(), (
            f"{what}: parameter {n} is not initialised (fresh memory, filled with NaN here, is still there after "
            "init_weights): fill it in the part's reset_parameters, or create it with a value")


def check_model(spec: ModelSpec, what: str) -> None:
    """A tiny model with the part: forward shapes and dtypes, gradients everywhere, causal, left
    padding invisible to real tokens, incremental decoding equal to a full forward, meta build."""
    from zoo.model.decoder import Decoder

    assert_builds_on_meta(lambda: Decoder(spec), what)
    assert_initialised(spec, what)
    model = tiny_model(spec)
    V, T = spec.vocab_size, 12
    ids = torch.randint(0, V, (2, T), generator=torch.Generator().manual_seed(0))
    logits = model(ids)
    assert logits.shape == (2, T, V), f"{what}: logits of shape {tuple(logits.shape)}, expected {(2, T, V)}"
    _finite(logits, what)
    model.train()
    assert_grads(model, model.loss(ids).loss, what=f"{what} (model)")
    model.eval()
    with torch.no_grad():
        assert_causal(model, ids, 7, lambda x: torch.cat([x[:, :7], (x[:, 7:8] + 1) % V, x[:, 8:]], 1), f"{what} (model)")
        pad = 3
        padded = torch.cat([torch.zeros(2, pad, dtype=ids.dtype), ids], 1)
        mask = torch.cat([torch.zeros(2, pad, dtype=torch.long), torch.ones(2, T, dtype=torch.long)], 1)
        _close(model(padded, attention_mask=mask)[:, pad:], logits, f"{what}: left padding changed the real tokens' logits", atol=1e-4)
        check_decoding(model, ids, logits, what)
    bf16 = tiny_model(spec, dtype=torch.bfloat16)
    with torch.no_grad():
        out = bf16(ids)
    assert out.dtype == torch.bfloat16, f"{what}: a bfloat16 model gave {out.dtype} logits"
    _finite(out, f"{what} (bfloat16 model)")


def check_decoding(model, ids: torch.Tensor, full: Optional[torch.Tensor] = None, what: str = "model",
                   atol: float = 1e-4) -> None:
    """Incremental decoding computes what the full forward computes, for every mixer, always:

    - the prompt prefilled, then one token at a time (past any window the mixers have, when the
      sequence is longer than it);
    - several new tokens at once onto an existing state, with no length given up front;
    - a left-padded batch whose rows have different padding;
    - the static state that compiled decoding uses (``DecodeState.to_static``), one token a step.

    A model with a mixer that keeps no decode state fails here, naming the mixer.
    """
    B, T = ids.shape
    with torch.no_grad():
        full = model(ids) if full is None else full
        try:
            state = model.new_state(B, T)
        except ValueError as exc:
            raise AssertionError(f"{what}: cannot decode incrementally: {exc}") from None
        steps = [model(ids[:, :5], state=state)] + [model(ids[:, t : t + 1], state=state) for t in range(5, T)]
        _close(torch.cat(steps, 1), full, f"{what}: prefill then one token at a time differs from the full forward",
               atol=atol)

        state = model.new_state(B, None)
        cuts = [0, 3, 7, 9, T]
        steps = [model(ids[:, a:b], state=state) for a, b in zip(cuts, cuts[1:])]
        _close(torch.cat(steps, 1), full, f"{what}: several new tokens onto an existing state differ from the full "
               "forward", atol=atol)

        # Row 0 is left-padded by 3 slots; row 1 has 3 more real tokens in front instead.
        V = model.spec.vocab_size
        extra = torch.randint(0, V, (3,), generator=torch.Generator().manual_seed(1))
        padded = torch.stack([torch.cat([torch.zeros(3, dtype=ids.dtype), ids[0]]), torch.cat([extra, ids[1]])])
        mask = torch.ones_like(padded)
        mask[0, :3] = 0
        ref = [model(ids[:1]), model(padded[1:])[:, 3:]]
        state = model.new_state(2, T + 3)
        steps = [model(padded[:, :8], attention_mask=mask[:, :8], state=state)]
        steps += [model(padded[:, t : t + 1], state=state) for t in range(8, T + 3)]
        got = torch.cat(steps, 1)[:, 3:]
        _close(got[:1], ref[0], f"{what}: decoding a left-padded row differs from the row alone", atol=atol)
        _close(got[1:], ref[1], f"{what}: decoding beside a padded row differs from the row alone", atol=atol)

        state = model.new_state(B, 5)
        steps = [model(ids[:, :5], state=state)]
        try:
            static = state.to_static(T + 2)
        except TypeError as exc:
            raise AssertionError(f"{what}: no static state for compiled decoding: {exc}") from None
        steps += [model(ids[:, t : t + 1], state=static) for t in range(5, T)]
        _close(torch.cat(steps, 1), full, f"{what}: decoding with the static state (compiled decoding's) differs "
               "from the full forward", atol=atol)


@contract("norm")
def _norm(kind: str, name: str, config: dict[str, Any]) -> None:
    p, D, what = part(kind, name, config), 32, f"norm {name!r} {config}"
    assert_builds_on_meta(lambda: p.build(dim=D), what)

    def run(dtype):
        return p.build(dim=D).to(dtype)(torch.randn(2, 5, D).to(dtype))

    _dtypes_ok(run, what)
    norm = p.build(dim=D)
    x = torch.randn(2, 5, D, requires_grad=True)
    y = norm(x)
    assert y.shape == x.shape, f"{what}: output shape {tuple(y.shape)} for input {tuple(x.shape)}"
    assert_grads(norm, y, (x,), what)
    # What a norm is for: the output's size is bounded however large the input grows.
    with torch.no_grad():
        for scale in (1e-2, 1.0, 1e4):
            big = norm(torch.randn(4, D) * scale)
            _finite(big, f"{what} at input scale {scale}")
            assert big.abs().max() <= math.sqrt(D) * 1.01, (
                f"{what}: at its initial weights, an input of scale {scale} gives outputs up to "
                f"{big.abs().max().item():.3g} > sqrt(dim) = {math.sqrt(D):.3g}: it does not control the scale"
            )
    check_model(tiny_spec_with(kind, name, config), what)


@contract("activation")
def _activation(kind: str, name: str, config: dict[str, Any]) -> None:
    p, what = part(kind, name, config), f"activation {name!r} {config}"
    act = p.build()
    _dtypes_ok(lambda dtype: act(torch.randn(3, 7).to(dtype)), what)
    x = torch.randn(3, 7, requires_grad=True)
    y = act(x)
    assert y.shape == x.shape, f"{what}: output shape {tuple(y.shape)} for input {tuple(x.shape)}"
    assert_grads(act, y, (x,), what)
    with torch.no_grad():  # pointwise: each output depends on its own input only
        flat = x.detach().flatten()
        perm = torch.randperm(flat.numel())
        _close(act(flat[perm]), act(flat)[perm], f"{what}: not pointwise")
        _close(torch.stack([act(v.reshape(1)) for v in flat[:5]]).flatten(), act(flat)[:5], f"{what}: not pointwise")
    check_model(tiny_spec_with(kind, name, config), what)


@contract("ffn")
def _ffn(kind: str, name: str, config: dict[str, Any]) -> None:
    p, D, what = part(kind, name, config), 32, f"ffn {name!r} {config}"
    assert_builds_on_meta(lambda: p.build(d_model=D), what)
    _dtypes_ok(lambda dtype: p.build(d_model=D).to(dtype)(torch.randn(2, 6, D).to(dtype)), what)
    ffn = p.build(d_model=D)
    x = torch.randn(2, 6, D, requires_grad=True)
    y = ffn(x)
    assert y.shape == x.shape, f"{what}: output shape {tuple(y.shape)} for input {tuple(x.shape)}"
    assert_grads(ffn, y, (x,), what)
    with torch.no_grad():  # position-wise: a token's output depends on that token only
        x2 = x.detach().clone()
        x2[:, 3] += 1.0
        y2, y0 = ffn(x2), ffn(x.detach())
        _close(torch.cat([y2[:, :3], y2[:, 4:]], 1), torch.cat([y0[:, :3], y0[:, 4:]], 1), f"{what}: mixes tokens")
    check_model(tiny_spec_with(kind, name, config), what)


#: The MoE FFN a router is checked inside: 8 experts, top-2, groups for group-limited routers.
ROUTER_FFN: dict[str, Any] = {"name": "moe", "n_experts": 8, "top_k": 2, "d_ff": 16}


@contract("router")
def _router(kind: str, name: str, config: dict[str, Any]) -> None:
    """A router picks ``top_k`` distinct experts per token with finite, non-negative float32 weights,
    in float32 whatever the model's dtype; each token's choice depends on that token only; inside an
    ``moe`` FFN it passes the FFN and model contracts."""
    what, D, E, k = f"router {name!r} {config}", 32, ROUTER_FFN["n_experts"], ROUTER_FFN["top_k"]
    p = part(kind, name, config)
    assert_builds_on_meta(lambda: p.build(d_model=D, n_experts=E, top_k=k), what)
    for dtype in (torch.float32, torch.bfloat16):
        router = p.build(d_model=D, n_experts=E, top_k=k).to(dtype)
        x = torch.randn(20, D).to(dtype)
        r = router(x)
        assert r.indices.shape == (20, k) and r.weights.shape == (20, k), f"{what}: indices {tuple(r.indices.shape)}, weights {tuple(r.weights.shape)}"
        for t in (r.logits, r.probs, r.weights):
            assert t.dtype == torch.float32, f"{what}: a {dtype} model routes in {t.dtype}, expected float32"
            _finite(t, what)
        assert ((r.indices >= 0) & (r.indices < E)).all(), f"{what}: expert indices outside [0, {E})"
        assert (r.indices.sort(-1).values.diff(dim=-1) != 0).all(), f"{what}: a token chose one expert twice"
        assert (r.weights >= 0).all(), f"{what}: negative routing weights"
        one = router(x[3:4])
        assert torch.equal(one.indices.sort(-1).values, r.indices[3:4].sort(-1).values), f"{what}: a token's choice depends on other tokens"
    ffn = {**ROUTER_FFN, "router": {"name": name, **config}}
    _ffn("ffn", "moe", ffn)


@contract("expert")
def _experts(kind: str, name: str, config: dict[str, Any]) -> None:
    """Stacked experts: built on meta; token copies grouped by expert give one output row per row,
    each row depending on that row alone (its expert's); the grouped and loop paths agree; gradients
    reach every parameter; inside an ``moe`` FFN they pass the FFN and model contracts."""
    what, D, Fd, E = f"expert {name!r} {config}", 32, 16, 4
    p = part(kind, name, config)
    build = lambda dispatch="loop": p.build(n_experts=E, d_model=D, d_ff=Fd, dispatch=dispatch)  # noqa: E731
    assert_builds_on_meta(build, what)
    experts = build()
    with torch.no_grad():
        for param in experts.parameters():  # biases start at zero: move them so that they show
            param.add_(0.1 * torch.randn(param.shape, generator=torch.Generator().manual_seed(2)))
    counts = torch.tensor([3, 0, 4, 2])
    xs = torch.randn(int(counts.sum()), D, requires_grad=True)
    ys = experts(xs, counts)
    assert ys.shape == (xs.shape[0], D), f"{what}: output of shape {tuple(ys.shape)} for {tuple(xs.shape)} token copies"
    _finite(ys, what)
    with torch.no_grad():
        bumped = xs.detach().clone()
        bumped[4] += 1.0
        moved = (experts(bumped, counts) - ys).abs().amax(-1)
        assert moved[4] > 0 and (torch.cat([moved[:4], moved[5:]]) == 0).all(), f"{what}: a row's output depends on other rows"
        grouped = build("auto")  # grouped where torch._grouped_mm runs here
        grouped.load_state_dict(experts.state_dict())
        if grouped.choose_path(xs.device, xs.dtype)[0] == "grouped":
            _close(grouped(xs.detach(), counts), ys, f"{what}: the grouped path differs from the loop path")
    assert_grads(experts, ys, (xs,), what)
    _ffn("ffn", "moe", {"n_experts": E, "top_k": 2, "d_ff": Fd, "expert": {"name": name, **config}})


@contract("position")
def _position(kind: str, name: str, config: dict[str, Any]) -> None:
    what = f"position {name!r} {config}"
    spec = tiny_spec_with(kind, name, config)
    build = lambda: spec.position.build(spec=spec, layer=spec.layer(0))  # noqa: E731
    assert_builds_on_meta(build, what)
    pos = build()
    applies = pos.applies_to
    B, T, H = 2, 6, 4
    ids = torch.arange(T).expand(B, T)
    emb = pos.embed(ids, torch.float32)
    if applies == "embedding":
        assert emb is not None and emb.shape == (B, T, spec.d_model), f"{what}: embed gave {None if emb is None else tuple(emb.shape)}"
        _dtypes_ok(lambda dtype: pos.embed(ids, dtype), what)
        _close(pos.embed(torch.tensor([[4]]), torch.float32)[0, 0], emb[0, 4], f"{what}: embedding of a position depends on its neighbours")
        assert not torch.allclose(emb[0, 1], emb[0, 2]), f"{what}: positions 1 and 2 get the same embedding"
    else:
        assert emb is None, f"{what}: applies_to={applies!r} but embed() returned a tensor"
    D = rotary_dim_of(spec.layer(0), spec.d_model)
    q, k = torch.randn(1, H, 1, D), torch.randn(1, H, 1, D)
    qr, kr = pos.rotate(q, k, pos.prepare(torch.tensor([[3]]), torch.float32))
    assert qr.shape == q.shape and kr.shape == k.shape, f"{what}: rotate changed shapes"
    if applies != "qk":
        _close(qr, q, f"{what}: applies_to={applies!r} but rotate() changed the queries")
    bias = pos.score_bias(pos.prepare(ids, torch.float32), torch.arange(T), torch.arange(T), H)
    if applies == "bias":
        assert bias is not None, f"{what}: applies_to='bias' but score_bias() returned None"
        assert bias.ndim == 4 and bias.shape[-3:] == (H, T, T) and bias.shape[0] in (1, B), (
            f"{what}: score_bias gave shape {tuple(bias.shape)}, expected (1 or B, {H}, {T}, {T})")
        _finite(bias, what)
    else:
        assert bias is None, f"{what}: applies_to={applies!r} but score_bias() returned a bias"
    if applies in ("qk", "bias"):  # relative: a score depends on m - n only
        for m, n, shift in ((5, 2, 7), (3, 3, 11), (9, 0, 20)):
            _close(qk_scores(pos, q, k, m + shift, n + shift), qk_scores(pos, q, k, m, n),
                   f"{what}: the score at positions ({m}, {n}) changes when both move by {shift}", atol=1e-4, rtol=1e-4)
    check_model(spec, what)


@contract("rope_scaling")
def _rope_scaling(kind: str, name: str, config: dict[str, Any]) -> None:
    p, what = part(kind, name, config), f"rope_scaling {name!r} {config}"
    dim, theta = 16, 10000.0
    scaling = p.build(dim=dim, theta=theta)
    base = 1.0 / theta ** (torch.arange(0, dim, 2).float() / dim)
    for seq_len in (None, 16, 100_000):
        inv_freq, factor = scaling.frequencies(seq_len)
        assert inv_freq.shape == (dim // 2,), f"{what}: {tuple(inv_freq.shape)} frequencies for rotary dim {dim}"
        assert inv_freq.dtype == torch.float32, f"{what}: frequencies in {inv_freq.dtype}, expected float32"
        _finite(inv_freq, what)
        assert (inv_freq > 0).all(), f"{what}: non-positive frequencies"
        assert float(factor) > 0, f"{what}: attention factor {factor}"
        # A scaling stretches the context: it may slow rotations down, never speed them up.
        assert (inv_freq <= base * (1 + 1e-5)).all(), f"{what}: some frequencies exceed the unscaled ones"
    check_model(tiny_spec_with(kind, name, config), what)


@contract("mixer")
@contract("block")
def _sequence_mixer(kind: str, name: str, config: dict[str, Any]) -> None:
    """Mixers and blocks: called as ``(x, ctx, pos)``, shape-preserving, causal; in a model they
    decode incrementally as the full forward computes (see :func:`check_decoding`), and a mixer
    does so beside standard attention too (a hybrid)."""
    what = f"{kind} {name!r} {config}"
    spec = tiny_spec_with(kind, name, config)
    layer = spec.layer(0)
    context = {"spec": spec, "layer": layer, "index": 0, **({"d_model": spec.d_model} if kind == "mixer" else {})}
    build = lambda: getattr(layer, kind).build(**context)  # noqa: E731
    assert_builds_on_meta(build, what)
    module = build()
    x, ctx, rot = attention_inputs(spec)
    if kind == "mixer" and not module.mixes_tokens:  # mixer ``none``: the layer is its FFN
        y = module(x, ctx, rot)
        assert y.shape == x.shape and not y.any(), f"{what}: declares mixes_tokens = False but its output is not zeros"
        assert not list(module.parameters()), f"{what}: declares mixes_tokens = False but has parameters"
        check_model(hybrid_spec(name, config, **{"layers.part.block": "ffn_only"}), f"{what} beside standard attention")
        return
    x.requires_grad_(True)
    y = module(x, ctx, rot)
    assert y.shape == x.shape, f"{what}: output shape {tuple(y.shape)} for input {tuple(x.shape)}"
    assert_grads(module, y, (x,), what, aux=ctx.aux_total())  # a part trained by its own loss (DSA's indexer)
    with torch.no_grad():
        bump = lambda h: h + (torch.arange(h.shape[1]) == 6)[None, :, None]  # noqa: E731
        assert_causal(lambda h: module(h, ctx, rot), x.detach(), 6, bump, what)
    check_model(spec, what)
    if kind == "mixer":
        check_model(hybrid_spec(name, config), f"{what} beside standard attention")


@contract("stability")
def _stability(kind: str, name: str, config: dict[str, Any]) -> None:
    fn, what = _registry.get(kind, name), f"stability {name!r} {config}"
    for dtype in (torch.float32, torch.bfloat16):
        x = (torch.randn(3, 11) * 30).to(dtype).requires_grad_(True)
        y = fn(x, **config)
        assert isinstance(y, torch.Tensor), f"{what}: returned {type(y).__name__}, expected a tensor"
        _finite(y, f"{what} in {dtype}")
        y.float().sum().backward()
        assert x.grad is not None and torch.isfinite(x.grad).all(), f"{what}: no finite gradient in {dtype}"


@contract("family")
def _family(kind: str, name: str, config: dict[str, Any]) -> None:
    """Every preset validates, builds on the meta device with its published parameter count (when
    given), and a shrunk copy of the first preset runs forward and backward."""
    from zoo.model.recipes import build, get_spec

    fam = _registry.get(kind, name)
    assert fam.presets, f"family {name!r} has no presets"
    for preset in fam.presets:
        model = build(preset, device="meta")
        published = fam.presets[preset].get("params")
        if published is not None:
            assert model.num_parameters() == published, (
                f"family {name!r}: preset {preset!r} has {model.num_parameters():,} parameters, published {published:,}")
        for repo in fam.hf_ids(preset):
            assert get_spec(repo) == model.spec, f"family {name!r}: {repo!r} does not resolve to {preset!r}"
    check_model(shrink(fam.spec(next(iter(fam.presets)))), f"family {name!r}")


def shrink(spec: ModelSpec, *, n_layers: int = 2, d_model: int = 32, vocab_size: int = 64, head_dim: int = 8,
           d_ff: int = 64, window: int = 4) -> ModelSpec:
    """A tiny copy of ``spec`` with the same structure: few layers, narrow, short windows.

    Each part shrinks itself: a part class with ``shrink(config, head_dim=, d_ff=, window=,
    d_model=)`` returns the settings to change (attention: 4 heads of ``head_dim``, MHA/GQA/MQA
    kept, the window cut; an FFN: its width); parts without one are left as they are.
    """
    data = spec.to_dict()
    data.update(n_layers=n_layers, d_model=d_model, vocab_size=vocab_size, max_seq_len=64)
    data.get("embedding", {}).pop("padded_vocab_size", None)
    sizes = {"head_dim": head_dim, "d_ff": d_ff, "window": window, "d_model": d_model}
    for kind, layer in spec.layers.items():
        for slot in ("mixer", "ffn", "norm", "block", "position"):
            part = getattr(layer, slot)
            if part is not None and _kinds.implements(part.cls, "shrink"):
                fn = part.cls.shrink
                table = data["layers"][kind][slot]
                if isinstance(table, str):
                    table = data["layers"][kind][slot] = {"name": table}
                table.update(fn(part.config, **sizes))
    if spec.position is not None and _kinds.implements(spec.position.cls, "shrink") and isinstance(data.get("position"), dict):
        data["position"].update(spec.position.cls.shrink(spec.position.config, **sizes))
    return ModelSpec.from_dict(data)


def one_of_each(spec: ModelSpec | str, **sizes: Any) -> ModelSpec:
    """A tiny copy (:func:`shrink`, with ``sizes``) of a spec or preset name with one layer of each of
    its layer kinds, in the order the spec names them (DeepSeek-V3: a dense layer, then an MoE one)."""
    from zoo.model.recipes import get_spec

    spec = get_spec(spec) if isinstance(spec, str) else spec
    data = shrink(spec, **{"n_layers": len(spec.layers), **sizes}).to_dict()
    data["layer_pattern"] = list(spec.layers)
    return ModelSpec.from_dict(data)


@contract("checkpoint_format")
def _checkpoint_format(kind: str, name: str, config: dict[str, Any]) -> None:
    """The format's tiny config becomes a spec; a model of it saved in the format (weight map
    and config.json, both written from the one two-way map) loads back with the same weights and
    logits. Parity with the reference implementation is for the format's own tests."""
    import tempfile

    from zoo.checkpoints import config_to_spec, from_pretrained, save_pretrained

    fmt, what = _registry.get(kind, name), f"checkpoint_format {name!r}"
    tiny = {**getattr(fmt, "tiny", {}), **config}
    assert tiny, f"{what}: give the format a `tiny` config (a small config.json of its model_type)"
    config = {"model_type": name, **tiny}
    spec = config_to_spec(config)
    # A wrapper format (a multimodal checkpoint's text model) saves as the format it wraps.
    saves_as = fmt.unwrap(config)[0].get("model_type") or name
    model = tiny_model(spec)
    with tempfile.TemporaryDirectory() as d:
        save_pretrained(model, d, model_type=saves_as)
        loaded = from_pretrained(d)
    a, b = model.state_dict(), loaded.state_dict()
    assert a.keys() == b.keys(), f"{what}: the loaded model has other parameters: {sorted(set(a) ^ set(b))[:5]}"
    for k in a:
        assert torch.equal(a[k], b[k]), f"{what}: {k!r} changed through save and load"
    ids = torch.randint(0, spec.vocab_size, (1, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(model(ids), loaded(ids)), f"{what}: logits changed through save and load"


@contract("kernel")
def _kernel(kind: str, name: str, config: dict[str, Any]) -> None:
    """A fast backend names its implementation by an import path that exists (imported only when
    it runs). That it matches the component's reference path is for the kernel's own tests."""
    import importlib.util

    backend, what = _registry.get(kind, name), f"kernel {name!r}"
    module, sep, attr = getattr(backend, "target", "").partition(":")
    assert sep and module and attr, f"{what}: target {getattr(backend, 'target', None)!r} is not 'module:attribute'"
    assert importlib.util.find_spec(module) is not None, f"{what}: module {module!r} of its target does not exist"
    assert callable(getattr(backend, "load", None)), f"{what}: has no load() for its implementation"

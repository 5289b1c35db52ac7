"""Choosing between a component's plain PyTorch path and its fast kernels (Triton, FlexAttention).

A component declares, as class-level facts, the key it is known by here (``kernel = "rmsnorm"``)
and its backends in order of preference (``backends = ("triton", "torch")``); the plain PyTorch
code is the reference and the default. Fast backends are registered by plugins under the registry
kind ``kernel`` as :class:`Backend` entries naming their implementation by import path, so
nothing (Triton included) is imported until a fast path actually runs.

What runs is decided per call from the tensor: a fast backend is used when its device (CUDA),
the dtype and the shapes allow, and Triton is importable. ``ZOO_KERNELS`` (or :func:`configure`,
or the :func:`using` context manager) switches fast paths off or forces them::

    ZOO_KERNELS=off                        # every component on its reference path
    ZOO_KERNELS=rmsnorm:off,attention:flex # per component: off, auto or a backend name
    ZOO_KERNELS=triton                     # force Triton wherever a component has it

:func:`backend_table` says what would run for each component of a model.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import os
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Optional

import torch

from zoo.core import kinds as _kinds
from zoo.core import registry as _registry

KIND = "kernel"
ENV = "ZOO_KERNELS"
FLOAT_DTYPES = ("float16", "bfloat16", "float32")


@dataclass(frozen=True)
class Backend:
    """A fast implementation of one component: ``target`` is ``"module:attribute"``, imported on
    first use. ``needs`` is what must be importable ("triton", or "flex" for FlexAttention);
    ``devices`` are where it is chosen automatically; ``dtypes`` the tensor dtypes it accepts."""

    component: str
    name: str
    target: str
    needs: str = "triton"
    devices: tuple[str, ...] = ("cuda",)
    dtypes: tuple[str, ...] = FLOAT_DTYPES
    # Runs inside torch.compile: traced with the model (FlexAttention), or called as it is, a custom
    # operator the compiler does not look into (the fused loss). Others step aside there for the
    # reference, which the compiler fuses itself.
    traced: bool = False

    def load(self) -> Callable:
        module, _, attr = self.target.partition(":")
        return getattr(importlib.import_module(module), attr)


class Availability:
    """Whether fast kernels can run here, and if not, why. True-ish when they can."""

    def __init__(self, ok: bool, reason: str):
        self.ok, self.reason = ok, reason

    def __bool__(self) -> bool:
        return self.ok

    def __repr__(self) -> str:
        return f"Availability(ok={self.ok}, reason={self.reason!r})"


def interpreting() -> bool:
    """True under ``TRITON_INTERPRET=1``: Triton kernels run on CPU tensors (slowly), for tests."""
    return os.environ.get("TRITON_INTERPRET", "") not in ("", "0")


def available(needs: str = "triton") -> Availability:
    """Can ``needs`` ("triton" or "flex") kernels run in this process? ``.reason`` says why not."""
    if needs == "flex":
        try:
            importlib.import_module("torch.nn.attention.flex_attention")
        except ImportError:
            return Availability(False, f"torch {torch.__version__} has no torch.nn.attention.flex_attention (needs >= 2.5)")
        if not torch.cuda.is_available():
            return Availability(False, "no CUDA device (FlexAttention is chosen automatically on CUDA only)")
        return Availability(True, "FlexAttention on CUDA")
    if not _importable("triton"):
        return Availability(False, "Triton is not installed (pip install 'zoo-lm[triton]')")
    if interpreting():
        return Availability(True, "Triton interpreter (TRITON_INTERPRET=1)")
    if not torch.cuda.is_available():
        return Availability(False, "no CUDA device")
    return Availability(True, f"Triton on {torch.cuda.get_device_name()}")


# -- settings ---------------------------------------------------------------------------------

_override: Optional[str] = None
_parsed: dict[str, dict[str, str]] = {}


def configure(setting: Optional[str]) -> None:
    """Set the backends for this process in ``ZOO_KERNELS`` syntax (it takes precedence over the
    environment variable); ``None`` goes back to the environment."""
    global _override
    if setting is not None:
        _parse(setting)  # fail now, not at the first forward
    _override = setting


@contextlib.contextmanager
def using(setting: Optional[str]) -> Iterator[None]:
    """``with zoo.core.kernels.using("off"): ...`` runs the block with ``setting`` in force."""
    global _override
    before = _override
    configure(setting)
    try:
        yield
    finally:
        _override = before


def _setting_text() -> str:
    return _override if _override is not None else os.environ.get(ENV, "")


def _parse(text: str) -> dict[str, str]:
    """``"off"`` / ``"triton"`` / ``"rmsnorm:off,attention:flex"`` -> {component or "*": value}."""
    if text in _parsed:
        return _parsed[text]
    out: dict[str, str] = {}
    for item in filter(None, (s.strip() for s in text.split(","))):
        component, sep, value = item.rpartition(":")
        component, value = (component.strip() if sep else "*"), value.strip().lower()
        if not value or (sep and not component):
            raise ValueError(f"{ENV}: cannot read {item!r}; expected VALUE or COMPONENT:VALUE, e.g. 'rmsnorm:off'")
        out[component] = value
    known = components()
    for component, value in out.items():
        if component != "*" and component not in known:
            raise ValueError(f"{ENV}: unknown component {component!r}; components with fast kernels: {', '.join(sorted(known))}")
        names = {"off", "auto", "on"} | ({b for c in known.values() for b in c} if component == "*" else _declared(component))
        if value not in names:
            raise ValueError(f"{ENV}: {component}:{value} is not a choice; use one of {', '.join(sorted(names))}")
    _parsed[text] = out
    return out


_cache: dict = {}


def refresh() -> None:
    """Forget cached look-ups and decisions (call after registering a kernel backend at run time)."""
    _cache.clear()
    _parsed.clear()


def components() -> dict[str, dict[str, Backend]]:
    """Every registered fast backend, by component key and backend name."""
    if "components" not in _cache:
        mgr = _registry.manager()
        mgr.ensure_loaded()
        reg = mgr.registries.get(KIND)
        out: dict[str, dict[str, Backend]] = {}
        for name in reg.names() if reg is not None else []:
            b = reg.get(name)
            out.setdefault(b.component, {})[b.name] = b
            if b.traced and (b.needs != "triton" or _importable("triton")):  # imported now, so that
                _cache[("impl", b.component, b.name)] = b.load()                # a compile never traces an import
        _cache["components"] = out
    return _cache["components"]


def _importable(name: str) -> bool:
    key = ("importable", name)
    if key not in _cache:
        try:
            _cache[key] = importlib.util.find_spec(name) is not None
        except ImportError:
            _cache[key] = False
    return _cache[key]


def _declared(component: str) -> set[str]:
    """Backend names a component accepts: its fast ones and the reference ones its parts declare."""
    names = {"torch"} | set(components().get(component, {}))
    registries = _registry.manager().registries
    for kind in _kinds.BASES:
        reg = registries.get(kind)
        for name in reg.names() if reg is not None else ():
            obj = reg.get(name)
            if obj.kernel == component:
                names |= set(obj.backends)
    return names


def setting_for(component: str) -> str:
    """"auto", "off" or a backend name, from ``ZOO_KERNELS`` / :func:`configure`."""
    parsed = _parse(_setting_text())
    value = parsed.get(component, parsed.get("*", "auto"))
    if component not in parsed and value not in ("off", "auto", "on") and value not in components().get(component, {}):
        return "auto"  # a global backend name applies only where the component has it
    return value


# -- choosing ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Decision:
    backend: Optional[str]  # a fast backend's name, a reference backend's name when forced, or None
    reason: str


def decide(module: Any, device: torch.device | str, dtype: torch.dtype, x: Optional[torch.Tensor] = None) -> Decision:
    """What ``module`` runs on ``device``/``dtype`` (and, given a tensor, its shape), and why."""
    key = module.kernel
    if key is None:
        return Decision(None, "no fast kernels declared")
    dev = device.type if isinstance(device, torch.device) else torch.device(device).type
    plan = _plan(type(module), key, dev, dtype, _setting_text(), interpreting())
    if isinstance(plan, Decision):
        return plan
    strict, forced, candidates = plan
    why = []
    for name, problem in candidates:
        if problem is None:
            problem = module.kernel_problem(name, x, forced=strict)
        if problem is None:
            return Decision(name, f"forced ({ENV})" if forced else f"{dev}, {str(dtype).removeprefix('torch.')}")
        if strict:
            raise RuntimeError(f"{ENV} forces {key}:{name} but it cannot run: {problem}")
        why.append(f"{name}: {problem}")
    return Decision(None, "; ".join(why) or "no fast backend registered")


def _plan(cls, key: str, dev: str, dtype: torch.dtype, text: str, interp: bool):
    """The part of a decision that depends only on the class, device, dtype and settings (cached):
    a final :class:`Decision`, or (strict, forced, [(backend, problem or None)])."""
    cache_key = ("plan", cls, key, dev, dtype, text, interp)
    if cache_key in _cache:
        return _cache[cache_key]
    declared = tuple(cls.backends)
    setting = setting_for(key)
    registered = components().get(key, {})
    forced = setting not in ("auto", "on", "off")
    if setting == "off":
        plan = Decision(None, f"switched off ({ENV})")
    elif forced and setting not in registered:
        if setting not in declared:
            raise ValueError(f"{ENV}: {cls.__name__} ({key}) has no backend {setting!r}; it has {', '.join(declared)}")
        plan = Decision(setting, f"forced ({ENV})")
    else:
        strict = forced or setting == "on"
        names = [setting] if forced else [b for b in declared if b in registered]
        plan = (strict, forced, [(n, _problem(registered[n], dev, dtype, strict)) for n in names])
    _cache[cache_key] = plan
    return plan


def _problem(backend: Backend, dev: str, dtype: torch.dtype, forced: bool) -> Optional[str]:
    if str(dtype).removeprefix("torch.") not in backend.dtypes:
        return f"dtype {dtype} not supported"
    if backend.needs == "triton":
        if not _importable("triton"):
            return "Triton is not installed (pip install 'zoo-lm[triton]')"
        if dev != "cuda" and not (forced and interpreting()):
            return f"tensors on {dev}; Triton runs on CUDA (or on the CPU with TRITON_INTERPRET=1, for tests)"
        return None
    if backend.needs == "flex" and not _importable("torch.nn.attention.flex_attention"):
        return f"torch {torch.__version__} has no FlexAttention (needs >= 2.5)"
    if not forced and dev not in backend.devices:
        return f"tensors on {dev}; chosen automatically on {', '.join(backend.devices)} only"
    return None


def select(module: Any, x: torch.Tensor) -> Optional[str]:
    """The backend ``module`` should use for input ``x``; ``None`` means its default path."""
    key = module.kernel
    if key is None:
        return None
    if not _setting_text() and x.device.type != "cuda":
        return None  # the common CPU case, decided without looking anything up
    name = decide(module, x.device, x.dtype, x).backend
    if name is not None and torch.compiler.is_compiling():
        backend = components().get(key, {}).get(name)
        if backend is not None and not backend.traced:
            return None  # under torch.compile the reference is traced and fused by the compiler
    return name


def implementation(component: str, backend: str) -> Callable:
    """The function registered for ``component``'s fast ``backend``."""
    key = ("impl", component, backend)
    if key not in _cache:
        found = components().get(component, {})
        if backend not in found:
            raise ValueError(f"{component} has no fast backend {backend!r}; registered: {', '.join(found) or 'none'}")
        _cache[key] = found[backend].load()
    return _cache[key]


def fast(module: Any, x: torch.Tensor) -> Optional[Callable]:
    """The fast implementation to call for ``module`` on ``x``, or ``None`` for the reference.

    Kernels take plain tensors. Under tensor or sequence parallelism a part may meet DTensors: as its
    ``kernel_on_shards`` says, the kernel then runs on each process's local rows (``local_map``), runs
    as it is (its input only reaches sub-layers that take DTensors), or steps aside to the reference
    path with a one-time message naming the part, the backend and why."""
    name = select(module, x)
    if name is None or name not in components().get(module.kernel, {}):
        return None
    fn = implementation(module.kernel, name)
    if not _dtensor_classes():  # torch without torch.distributed
        return fn
    rule = module.kernel_on_shards  # the hooks every part has (zoo.core.kinds), and the Decoder for its loss
    whole = [t for t in module.kernel_tensors() if isinstance(t, _dtensor_classes())]
    if rule == "rows":
        if not isinstance(x, _dtensor_classes()) and not any(isinstance(p, _dtensor_classes())
                                                             for p in module.parameters(recurse=False)):
            return fn if not whole else _step_aside(module, name, "it reads a sharded tensor whole")
        return _on_rows(module, fn, x, name)
    if whole:
        return _step_aside(module, name, "it reads a tensor that is sharded over processes (a DTensor) whole")
    if isinstance(x, _dtensor_classes()) and rule != "layers":
        return _step_aside(module, name, "its input is a DTensor (tensor or sequence parallelism)")
    return fn


def _dtensor_classes() -> tuple:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:
        return ()
    return (DTensor,)


_said: set = set()


def _step_aside(module: Any, backend: str, why: str) -> None:
    """None (the reference path), saying once per part class and reason that it steps aside."""
    import warnings

    key = (type(module).__name__, module.kernel, backend, why)
    if key not in _said:
        _said.add(key)
        warnings.warn(f"{type(module).__name__} ({module.kernel}): the {backend} kernel takes plain tensors and "
                      f"{why}: running the reference path instead", RuntimeWarning, stacklevel=3)
    return None


class _LocalView:
    """``module`` with some of its parameters replaced by local tensors, for a kernel that reads them
    as attributes (``module.weight``, ``module.cfg``)."""

    def __init__(self, module: Any, tensors: dict):
        self._module = module
        self.__dict__.update(tensors)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._module, name)


def _settled(t):
    """``t``, waited for when it is still an ``AsyncCollectiveTensor`` (a collective's result DTensor has
    not waited for yet), whose data a kernel must not read before then."""
    from torch.distributed._functional_collectives import AsyncCollectiveTensor

    return t.wait() if isinstance(t, AsyncCollectiveTensor) else t


class _Settled(torch.autograd.Function):
    """The identity on a local tensor, settled (:func:`_settled`) both ways: the input a kernel reads,
    and the gradient its backward reads. (Waiting outside autograd would cut the input's gradient.)"""

    @staticmethod
    def forward(ctx, t):
        return _settled(t).view(t.shape)

    @staticmethod
    def backward(ctx, g):
        return _settled(g)


def _on_rows(module: Any, fn: Callable, x: Any, backend: str) -> Optional[Callable]:
    """``fn`` run on this process's rows of ``x`` (as ``local_map`` would) with the part's (replicated)
    parameters whole; their gradient is summed over the mesh dimensions that split the rows. None
    (stepping aside) where that would be wrong: the last dimension split, or a parameter not replicated."""
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

    params = {n: p for n, p in module.named_parameters(recurse=False) if p is not None}
    if not isinstance(x, DTensor):
        return _step_aside(module, backend, "its parameters are DTensors but its input is not")
    if any(isinstance(pl, Shard) and pl.dim % x.ndim == x.ndim - 1 for pl in x.placements) or \
            any(not pl.is_shard() and not pl.is_replicate() for pl in x.placements):
        return _step_aside(module, backend, f"its input is split or partial along the normalised dimension ({x.placements})")
    if any(not isinstance(p, DTensor) or p.device_mesh != x.device_mesh
           or not all(pl.is_replicate() for pl in p.placements) for p in params.values()):
        return _step_aside(module, backend, "its parameters are not replicated on its input's mesh")
    rows_split = tuple(Partial() if pl.is_shard() else Replicate() for pl in x.placements)
    names = list(params)

    def on_rows(_module, x_):
        # local_map's own conversion would do the same, but it cuts the gradient of an input whose
        # local tensor is still an AsyncCollectiveTensor (an embedding's reduce-scattered output).
        local = {n: _Settled.apply(params[n].to_local(grad_placements=rows_split)) for n in names}
        y = fn(_LocalView(module, local), _Settled.apply(x_.to_local(grad_placements=x_.placements)))
        return DTensor.from_local(_Settled.apply(y), x_.device_mesh, x_.placements, run_check=False)

    return on_rows


def attention_backend(name: str) -> Callable:
    """The attention implementation registered as ``name`` (e.g. "flex"), called as
    ``fn(attention_module, q, k, v, q_idx, k_idx, key_mask, bias)``."""
    return implementation("attention", name)


def backend_table(model: torch.nn.Module, *, device: Any = None, dtype: Optional[torch.dtype] = None) -> list[dict]:
    """One row per component kind in ``model``: which modules, the backend that would run on
    ``device``/``dtype`` (default: the model's own), and why."""
    p = next(model.parameters(), None)
    device = torch.device(device) if device is not None else (p.device if p is not None else torch.device("cpu"))
    dtype = dtype or (p.dtype if p is not None else torch.float32)
    rows: dict[tuple, dict] = {}
    for name, module in model.named_modules():
        if not (isinstance(module, _kinds.Kernels) or _kinds.is_part(module)) or module.kernel is None:
            continue
        d = decide(module, device, dtype)
        reference = module.reference_backend()
        key = (module.kernel, type(module).__name__, d.backend, d.reason)
        row = rows.setdefault(key, {
            "component": module.kernel, "class": type(module).__name__, "modules": [],
            "backend": d.backend or reference, "fast": d.backend is not None and d.backend != reference,
            "reason": d.reason,
        })
        row["modules"].append(name or "(model)")
    return list(rows.values())


def format_table(rows: list[dict]) -> str:
    """``backend_table`` as aligned text."""
    w = max([10] + [len(r["component"]) for r in rows])  # scalar_decay, gated_delta are wider than 10
    c = max([13] + [len(r["class"]) for r in rows])
    b = max([8] + [len(r["backend"]) for r in rows])
    lines = [f"{'component':<{w}} {'class':<{c}} {'modules':>7}  {'backend':<{b}} why"]
    for r in rows:
        lines.append(f"{r['component']:<{w}} {r['class']:<{c}} {len(r['modules']):>7}  {r['backend']:<{b}} {r['reason']}")
    return "\n".join(lines)

"""Compile zoo's Triton kernels for a GPU that is not here, and say whether they fit it.

Triton compiles for a named target without a device (``ptxas`` and ``cuobjdump`` ship with it):
:func:`launches` runs a kernel's Python entry on small CPU tensors with every Triton launch
recorded instead of run (their outputs are left empty), and :func:`compile_launch` compiles one
recorded launch for sm_90 (H100/H200) and reads its shared memory (Triton's metadata), registers
and stack bytes per thread (``cuobjdump -res-usage``; the stack holds what spilled).

The shapes come from the presets (:func:`preset_problems`): each preset's recurrent mixers are
built on the meta device at full width and run one step with their fast path forced, and the
arguments their kernel would get are kept (no tensor is allocated). Each launch is compiled with
every launch configuration its call site may choose (:mod:`zoo.components.kernels.tuning`).

    python -m zoo.tools.kernel_fit                # every preset's kernels, a markdown table
    python -m zoo.tools.kernel_fit --json fit.json --presets qwen3-next-80b-a3b
    python -m zoo.tools.kernel_fit --triton-site DIR  # with the Triton installed in DIR instead, e.g.
        # pip install --no-deps --target DIR triton==3.6.0   (the GPU image's: shared memory moves between versions)

Run it with ``TRITON_INTERPRET`` unset: under the interpreter kernels are not compiled at all.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import inspect
import json
import re
import subprocess
import sys
import tempfile
from typing import Any, Iterator, Optional

import torch

import zoo.core.kernels as zk
from zoo.core.kinds import Kernels, PositionState
from zoo.model.decoder import Decoder
from zoo.model.recipes import get_spec, list_models

#: Shared memory one block may use, by compute capability (sm_90: 227 KiB of the SM's 228).
SHARED_LIMIT = {90: 232_448}
MAX_REGISTERS = 255
#: Stack bytes per thread (what spilled) a build may use, by input dtype: the TF32 builds bf16 models
#: run spill at most 3.8 KB on Triton 3.9 (8 warps: 1.5 KB); the IEEE fp32 builds, whose ``tl.dot``
#: is scalar FMA code, up to 17 KB. A build past these spills pathologically (before the launch
#: configurations were chosen, one spilled 35 KB).
MAX_STACK = {"bf16": 4096, "fp16": 4096, "fp32": 20480}
#: The components whose Triton kernels are driven from the presets' mixers.
RECURRENT = ("scalar_decay", "gated_delta")
_DTYPES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16", torch.int64: "i64",
           torch.int32: "i32", torch.int8: "i8", torch.bool: "i1", torch.uint8: "u8"}


@dataclasses.dataclass
class Launch:
    """One recorded launch: the kernel, its grid, its arguments by name, and the launch options."""

    kernel: Any
    grid: tuple
    args: dict
    num_warps: int = 4
    num_stages: int = 3

    @property
    def name(self) -> str:
        return self.kernel.fn.__module__.rsplit(".", 1)[-1] + "." + self.kernel.fn.__name__

    def constexprs(self) -> dict:
        return {name: self.args[name] for name, p in inspect.signature(self.kernel.fn).parameters.items()
                if "constexpr" in str(p.annotation)}


def _grid(grid, args) -> tuple:
    grid = grid(args) if callable(grid) else grid
    return tuple(int(g) for g in grid)


@contextlib.contextmanager
def recording() -> Iterator[list[Launch]]:
    """Inside, Triton launches are recorded (in the yielded list) instead of run (compiled kernels,
    and under ``TRITON_INTERPRET=1`` interpreted ones)."""
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    launches: list[Launch] = []

    def run(self, *args, grid, warmup, **kwargs):
        options = {k: kwargs.pop(k) for k in ("num_warps", "num_stages") if k in kwargs}
        params = inspect.signature(self.fn).parameters
        bound = dict(zip(params, args))
        bound.update(kwargs)
        bound.update({n: p.default for n, p in params.items() if n not in bound and p.default is not p.empty})
        launches.append(Launch(self, _grid(grid, bound), bound, **options))

    saved = JITFunction.run, InterpretedFunction.run
    JITFunction.run = InterpretedFunction.run = run
    try:
        yield launches
    finally:
        JITFunction.run, InterpretedFunction.run = saved


def _signature(launch: Launch):
    """Triton's signature, constants and attributes for the recorded arguments, specialised as its
    launcher would (16-byte-aligned pointers and multiples of 16 marked divisible, 1 a constant)."""
    sig, consts, attrs = {}, {}, {}
    for i, p in enumerate(launch.kernel.params):
        v = launch.args[p.name]
        if p.is_constexpr or v is None:
            sig[p.name], consts[p.name] = "constexpr", v
        elif torch.is_tensor(v):
            sig[p.name] = "*" + _DTYPES[v.dtype]
            if v.data_ptr() % 16 == 0:
                attrs[(i,)] = [["tt.divisibility", 16]]
        elif isinstance(v, bool):
            sig[p.name] = "i1"
        elif isinstance(v, int):
            if v == 1 and i not in launch.kernel.do_not_specialize:
                sig[p.name], consts[p.name] = "constexpr", 1
                continue
            sig[p.name] = "i32" if -2**31 <= v < 2**31 else "i64"
            if v % 16 == 0 and i not in launch.kernel.do_not_specialize:
                attrs[(i,)] = [["tt.divisibility", 16]]
        elif isinstance(v, float):
            sig[p.name] = "fp32"
        else:
            raise TypeError(f"{launch.name}: cannot type argument {p.name}={v!r}")
    return sig, consts, attrs


def cuobjdump() -> Optional[str]:
    """The path of Triton's ``cuobjdump`` (with its ``ptxas``), or None where it is missing."""
    try:
        import triton
        from triton.backends.nvidia.compiler import get_ptxas

        tools = (triton.knobs.nvidia.cuobjdump.path, get_ptxas(90).path)
    except Exception:  # no NVIDIA backend in this Triton, or its tools are missing
        return None
    return tools[0]


def compile_launch(launch: Launch, capability: int = 90) -> dict:
    """Compile ``launch`` for ``cuda`` sm_``capability``: shared memory (bytes per block),
    registers and stack (bytes per thread), and whether it fits the block's shared memory."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    sig, consts, attrs = _signature(launch)
    target = GPUTarget("cuda", capability, 32)
    kernel = triton.compile(ASTSource(launch.kernel, sig, consts, attrs), target=target,
                            options={"num_warps": launch.num_warps, "num_stages": launch.num_stages})
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(kernel.asm["cubin"])
        f.flush()
        usage = subprocess.run([cuobjdump(), "-res-usage", f.name], capture_output=True, text=True, check=True).stdout
    regs, stack = (int(re.search(rf"{key}:(\d+)", usage).group(1)) for key in ("REG", "STACK"))
    shared = kernel.metadata.shared
    return {"kernel": launch.name, "triton": triton.__version__, "constexprs": _plain(launch.constexprs()), "grid": list(launch.grid),
            "num_warps": launch.num_warps, "num_stages": launch.num_stages, "shared": shared,
            "shared_limit": SHARED_LIMIT[capability], "fits": shared <= SHARED_LIMIT[capability],
            "registers": regs, "stack": stack}


def _plain(d: dict) -> dict:
    return {k: (v if isinstance(v, (int, float, str, bool, type(None))) else str(v)) for k, v in d.items()}


# -- the problems the presets pose ---------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Problem:
    """A recurrent kernel call at one shape: the component, its tensors' shapes (batch 1, the
    time axis as recorded) and its other arguments, with the presets that make it."""

    component: str
    shapes: tuple  # per positional argument: a shape tuple, or None for an absent tensor
    kwargs: tuple  # sorted (name, value) pairs
    presets: tuple = ()

    @property
    def label(self) -> str:
        q, v = self.shapes[0], self.shapes[2]
        return f"{self.component} Dk={q[-1]} Dv={v[-1]} " + " ".join(f"{k}={x}" for k, x in self.kwargs)


class _Captured(Exception):
    pass


def preset_problems(names=None) -> list[Problem]:
    """The distinct recurrent-kernel calls of the presets ``names`` (default: every preset), with
    the shapes their mixers pass: each preset is built on the meta device with one period of its
    layer pattern, and each layer with a recurrent mixer runs on a meta input with the kernel
    forced until the kernel would be called."""
    found: dict[tuple, list[str]] = {}

    def recorder(component, backend):
        def record(*args, **kwargs):
            shapes = tuple(tuple(a.shape) if torch.is_tensor(a) else None for a in args if torch.is_tensor(a) or a is None)
            rest = tuple(sorted(kwargs.items())) + tuple((f"arg{i}", a) for i, a in enumerate(args)
                                                         if not torch.is_tensor(a) and a is not None)
            found.setdefault((component, shapes, rest), []).append(current)
            raise _Captured
        return record

    saved = zk.implementation, zk.interpreting
    zk.implementation, zk.interpreting = recorder, (lambda: True)
    try:
        for current in names or list_models():
            spec = get_spec(current)
            spec = get_spec(current, {"n_layers": len(spec.layer_pattern) if spec.layer_pattern else 1})
            with torch.device("meta"):
                model = Decoder(spec)
            layers = [(i, layer) for i, layer in enumerate(model.layers)
                      if any(isinstance(m, Kernels) and m.kernel in RECURRENT for m in layer.modules())]
            if not layers:
                continue
            ids = torch.zeros(1, 8, dtype=torch.long, device="meta")
            ctx = model.context(ids, None)
            x = model.embed_tokens(ids)
            states = {None: None, **{key: PositionState(pos, pos.prepare(ctx.position_ids, x.dtype))
                                     for key, pos in model.positions.items()}}
            with zk.using(",".join(f"{c}:triton" for c in RECURRENT)):
                for i, layer in layers:
                    try:
                        layer(x, ctx, states[model._pos_key[i]])
                    except _Captured:
                        pass
    finally:
        zk.implementation, zk.interpreting = saved
    return [Problem(c, s, k, tuple(dict.fromkeys(p))) for (c, s, k), p in found.items()]


def widened(problem: Problem, width: int) -> Problem:
    """The same call with key and value heads ``width`` wide (the head dims no preset uses yet)."""
    shapes = tuple(s[:-1] + (width,) if s is not None and len(s) == 4 else s for s in problem.shapes)
    return Problem(problem.component, shapes, problem.kwargs, (f"{problem.presets[0]} at head dim {width}",))


def launches(problem: Problem, dtype: torch.dtype, T: Optional[int] = None, every_config=True) -> list[Launch]:
    """Every launch (forward and backward, each configuration its call site may choose, or only
    the first) of ``problem`` with inputs in ``dtype`` and ``T`` steps (default: the largest chunk
    asked for)."""
    from zoo.components.kernels import tuning

    T = T or max([v for k, v in problem.kwargs if "chunk" in k] + [64])
    g = torch.Generator().manual_seed(0)
    tensors = []
    for i, s in enumerate(problem.shapes):
        if s is None:
            tensors.append(None)
            continue
        shape = s[:2] + (T,) + s[3:] if len(s) >= 3 else s
        t = torch.randn(shape, generator=g)
        t = t if len(s) == 3 else t.to(dtype)  # per-step decays and gates stay fp32, as the mixers pass them
        tensors.append(t.requires_grad_())
    import zoo.core.kernels as zk

    fn = zk.implementation(problem.component, "triton")
    kwargs = {k: v for k, v in problem.kwargs if not k.startswith("arg")}
    extra = [v for k, v in problem.kwargs if k.startswith("arg")]
    with recording() as recorded, (tuning.every_config() if every_config else contextlib.nullcontext()):
        out = fn(*tensors, *extra, **kwargs)
        torch.autograd.backward([o for o in out if o.requires_grad], [torch.ones_like(o) for o in out if o.requires_grad])
    return recorded


def table(rows: list[dict]) -> str:
    """The compile results as a markdown table."""
    head = "| kernel | shape | inputs | warps | stages | shared (B) | fits sm_90 | registers | stack (B/thread) |"
    lines = [head, "|" + "---|" * 9]
    for r in rows:
        shape = ", ".join(f"{k}={v}" for k, v in r["constexprs"].items() if k.startswith("B") or k == "C")
        lines.append(f"| {r['kernel']} | {shape} | {r['inputs']} | {r['num_warps']} | {r['num_stages']} | "
                     f"{r['shared']:,} | {'yes' if r['fits'] else '**no**'} | {r['registers']} | {r['stack']:,} |")
    return "\n".join(lines)


def survey(problems: list[Problem], dtypes=(torch.float32, torch.bfloat16), kernels=None, every_config=True) -> list[dict]:
    """Compile every launch of every problem in each dtype (of the ``kernels`` named, e.g.
    ``gated_deltanet._bwd``, if given); one row per distinct compile."""
    rows, seen = [], set()
    for problem in problems:
        for dtype in dtypes:
            for launch in launches(problem, dtype, every_config=every_config):
                if kernels and launch.name not in kernels:
                    continue
                key = (launch.name, tuple(sorted(_plain(launch.constexprs()).items())),
                       tuple(_signature(launch)[0].values()), launch.num_warps, launch.num_stages)
                if key in seen:
                    continue
                seen.add(key)
                row = compile_launch(launch)
                row.update(inputs=_DTYPES[dtype], problem=problem.label, presets=list(problem.presets))
                rows.append(row)
                print(f"{row['kernel']:<24} {row['inputs']} {row['constexprs']} w{row['num_warps']} s{row['num_stages']}: "
                      f"shared {row['shared']:,} {'fits' if row['fits'] else 'DOES NOT FIT'}, "
                      f"{row['registers']} registers, stack {row['stack']}", file=sys.stderr, flush=True)
    return rows


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--presets", default=None, help="comma-separated presets (default: all that have recurrent mixers)")
    p.add_argument("--widths", default="64,256", help="also each call at these head widths (default 64,256; '' for none)")
    p.add_argument("--widened-only", action="store_true", help="only the calls at --widths, not the presets' own")
    p.add_argument("--dtypes", default="fp32,bf16", help="input dtypes (default fp32,bf16)")
    p.add_argument("--kernels", default=None, help="only these kernels, e.g. gated_deltanet._bwd,recurrent._fwd")
    p.add_argument("--first-config", action="store_true", help="only the configuration used off a GPU")
    p.add_argument("--json", default=None, metavar="FILE", help="write the rows as JSON")
    p.add_argument("--triton-site", default=None, metavar="DIR",
                   help="compile with the Triton installed in DIR (pip install --no-deps --target DIR triton==VERSION)")
    a = p.parse_args(argv)
    if a.triton_site:  # again, in a fresh interpreter that finds DIR's Triton first
        import os

        if not os.path.isdir(os.path.join(a.triton_site, "triton")):
            sys.exit(f"--triton-site {a.triton_site}: no triton package there")
        args = list(sys.argv[1:] if argv is None else argv)
        i = args.index("--triton-site") if "--triton-site" in args else None
        args = args[:i] + args[i + 2:] if i is not None else [x for x in args if not x.startswith("--triton-site=")]
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [a.triton_site, os.environ.get("PYTHONPATH")]))}
        sys.exit(subprocess.run([sys.executable, "-m", "zoo.tools.kernel_fit", *args], env=env).returncode)
    if cuobjdump() is None:
        sys.exit("Triton's ptxas/cuobjdump are missing: cannot compile for sm_90 here")
    problems = preset_problems(a.presets.split(",") if a.presets else None)
    seen, extra = {pr.shapes for pr in problems}, []
    for width in (int(w) for w in a.widths.split(",") if w):
        for pr in problems:
            w = widened(pr, width)
            if w.shapes not in seen:
                seen.add(w.shapes)
                extra.append(w)
    problems = extra if a.widened_only else problems + extra
    dtypes = [{"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[d] for d in a.dtypes.split(",")]
    rows = survey(problems, dtypes, a.kernels and set(a.kernels.split(",")), not a.first_config)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)
    print(table(rows))
    return rows


if __name__ == "__main__":
    main()

"""Prove with logits that zoo computes what the reference computes on a checkpoint.

:func:`verify` runs transformers' model (eager attention) and zoo's on the same token ids and
reports max |Δlogits|, the mean KL divergence, top-1 agreement and the max |Δ| of every layer's
hidden state, so a mismatch is located and not just detected. A stored reference (input ids,
logits and hidden states in one safetensors file) lets verification run without transformers.
"""

from __future__ import annotations

import gc
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Optional

import torch

from zoo.checkpoints import CheckpointError, config_to_spec, from_pretrained, ignored_fields, open_source
from zoo.checkpoints.files.io import WeightFiles, reading
from zoo.core import registry as _registry
from zoo.inference.generate import length_limit

# Default pass criteria. fp32 must match closely; bf16 rounds every matmul, so it is judged by
# the distributions (KL, top-1), not by single logits. In bfloat16 and float16 these are floors:
# zoo's run is judged against the reference's float32 run, and may err up to twice as much as the
# reference's own run in that dtype does (low_precision_tolerances).
TOLERANCES = {
    "float32": {"max_abs": 1e-3, "mean_kl": 1e-6, "top1": 0.999},
    "bfloat16": {"max_abs": math.inf, "mean_kl": 2e-2, "top1": 0.95},
    "float16": {"max_abs": math.inf, "mean_kl": 1e-2, "top1": 0.95},
}


@dataclass
class Report:
    source: str
    model_type: str
    reference: str
    dtype: str
    shape: tuple[int, int]
    params: int
    max_abs: float
    mean_kl: float
    top1: float
    hidden: list[float] = field(default_factory=list)  # max |Δ| after embeddings, layer 1, ... (last: + final norm)
    # the same deltas over the reference's max |h| there: real models carry hidden states of 1e4-1e5
    hidden_rel: list[float] = field(default_factory=list)
    tolerances: dict[str, float] = field(default_factory=dict)
    ignored: list[str] = field(default_factory=list)  # config fields neither transformers nor zoo reads
    nonfinite: list[str] = field(default_factory=list)  # "name: n NaN, m Inf" for each weight that has any
    # In bfloat16/float16: zoo against the reference's float32 run, and the reference's own run in
    # this dtype against its float32 run ({"mean_kl", "top1"} each); None in float32 or without one.
    float32: Optional[dict[str, float]] = None
    reference_error: Optional[dict[str, float]] = None

    @property
    def passed(self) -> bool:
        t = self.tolerances
        kl, top1 = (self.float32["mean_kl"], self.float32["top1"]) if self.float32 else (self.mean_kl, self.top1)
        return not self.nonfinite and self.max_abs <= t["max_abs"] and kl <= t["mean_kl"] and top1 >= t["top1"]

    @property
    def worst_layer(self) -> Optional[int]:
        """The first layer whose hidden state departs (index into ``hidden``; 0 = embeddings)."""
        if not self.hidden:
            return None
        bound = self.tolerances["max_abs"] if math.isfinite(self.tolerances["max_abs"]) else None
        for i, d in enumerate(self.hidden):
            if not math.isfinite(d) or (bound is not None and d > bound):  # NaN compares false with anything
                return i
        return max(range(len(self.hidden)), key=self.hidden.__getitem__)

    def to_dict(self) -> dict:
        out = asdict(self)
        out["passed"] = self.passed
        out["tolerances"] = {k: (None if math.isinf(v) else v) for k, v in self.tolerances.items()}
        return out

    def summary(self) -> str:
        lines = [
            f"{self.source} ({self.model_type}, {self.params:,} parameters) vs {self.reference}, {self.dtype}, "
            f"batch x seq = {self.shape[0]} x {self.shape[1]}",
            f"  max |Δlogits| {self.max_abs:.3e}   mean KL {self.mean_kl:.3e}   top-1 agreement {self.top1:.4f}",
        ]
        if self.hidden:
            names = ["embeddings"] + [f"layer {i}" for i in range(1, len(self.hidden))]
            names[-1] += " + final norm"
            rel = self.hidden_rel if len(self.hidden_rel) == len(self.hidden) else [math.nan] * len(self.hidden)
            lines.append("  hidden-state max |Δ| (relative to the reference's max |h|): " + ", ".join(
                f"{n} {d:.2e} ({r:.1e})" for n, d, r in zip(names, self.hidden, rel)))
        if self.float32 and self.reference_error:
            z, r = self.float32, self.reference_error
            lines.append(f"  against the reference's float32 run: zoo {self.dtype} mean KL {z['mean_kl']:.3e}, top-1 "
                         f"{z['top1']:.4f}; the reference's own {self.dtype} run mean KL {r['mean_kl']:.3e}, top-1 "
                         f"{r['top1']:.4f}")
        if self.nonfinite:
            lines.append("  non-finite weights: " + "; ".join(self.nonfinite))
        if self.ignored:
            lines.append("  config fields transformers and zoo ignore (kept): " + ", ".join(self.ignored))
        t = self.tolerances
        rule = [f"max |Δlogits| <= {t['max_abs']:.0e}" if math.isfinite(t["max_abs"]) else None,
                f"mean KL <= {t['mean_kl']:.0e}", f"top-1 agreement >= {t['top1']:.4g}", "all weights finite"]
        against = (f" (zoo against the reference's float32 run; bounds: twice the reference's own {self.dtype} "
                   f"error, at least {TOLERANCES[self.dtype]['mean_kl']:.0e} and {1 - TOLERANCES[self.dtype]['top1']:.2f})"
                   if self.float32 else "")
        lines.append("  pass rule: " + ", ".join(r for r in rule if r) + against + " (hidden-state deltas locate a "
                     "departure; they do not decide the verdict)")
        verdict = "PASS" if self.passed else "FAIL"
        if not self.passed and self.worst_layer is not None:
            verdict += f" (first departs at {'embeddings' if self.worst_layer == 0 else f'layer {self.worst_layer}'})"
        lines.append("  " + verdict)
        return "\n".join(lines)


def compare_logits(out: torch.Tensor, ref: torch.Tensor) -> tuple[float, float, float]:
    """max |Δ|, mean KL(ref || out) per position, and top-1 agreement."""
    out, ref = out.float(), ref.float()
    logp_ref, logp_out = torch.log_softmax(ref, -1), torch.log_softmax(out, -1)
    kl = (logp_ref.exp() * (logp_ref - logp_out)).sum(-1).mean()
    top1 = (out.argmax(-1) == ref.argmax(-1)).float().mean()
    return float((out - ref).abs().max()), float(kl.clamp(min=0)), float(top1)


def low_precision_tolerances(dtype: str, reference_error: dict[str, float]) -> dict[str, float]:
    """The pass bounds in bfloat16 or float16, given the reference's own error there (its run in
    ``dtype`` against its float32 run on the same inputs): zoo's error against that float32 run may be
    twice the reference's (two implementations rounding differently), and never needs to be below the
    fixed floors of :data:`TOLERANCES`."""
    floor = TOLERANCES[dtype]
    return {"max_abs": floor["max_abs"],
            "mean_kl": max(floor["mean_kl"], 2 * reference_error["mean_kl"]),
            "top1": min(floor["top1"], 1 - 2 * (1 - reference_error["top1"]))}


def _dtype(name: str) -> torch.dtype:
    if name not in TOLERANCES:
        raise ValueError(f"unsupported dtype {name!r}; use one of: {', '.join(TOLERANCES)}")
    return getattr(torch, name)


def run_reference(directory: Path, ids: torch.Tensor, dtype: str):
    """transformers' logits and hidden states (eager attention) for ``ids``."""
    try:
        import transformers
    except ImportError:
        raise RuntimeError(
            "verifying against the reference needs transformers (pip install 'zoo-lm[reference]'), "
            "or a stored reference: --reference FILE"
        ) from None
    where = {"pretrained_model_name_or_path": str(directory)}
    if Path(directory).is_file():  # a GGUF file: transformers' own GGUF loader dequantises it
        where = {"pretrained_model_name_or_path": str(Path(directory).parent), "gguf_file": Path(directory).name}
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        **where, dtype=_dtype(dtype), attn_implementation="eager"
    ).eval()
    with torch.no_grad():
        out = hf(ids, output_hidden_states=True)
    logits, hidden = out.logits.float(), [h.float() for h in out.hidden_states]
    if getattr(_registry.get("checkpoint_format", hf.config.model_type), "hidden_states_skip_embeddings", False):
        # transformers lists each layer's output, then the normed last one, without the embeddings:
        # line them up with zoo's (embeddings, layer 1, ..., normed last layer).
        with torch.no_grad():
            hidden = [hf.get_input_embeddings()(ids).float(), *hidden[:-2], hidden[-1]]
    del hf, out
    gc.collect()
    return logits, hidden, f"transformers {transformers.__version__}"


# Logits and hidden states of both models beyond this are a mistake in --seq-len or --batch-size.
VERIFY_MAX_BYTES = 8 << 30


def _check_verify_inputs(spec, *, dtype: str, batch_size: int, seq_len: int, reference, save_reference) -> None:
    """Refuse, naming the argument, what would fail midway (or allocate without bound)."""
    _dtype(dtype)
    if reference is None:
        for name, value in (("batch_size", batch_size), ("seq_len", seq_len)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        limit, why = length_limit(spec)  # RoPE may run past max_seq_len, as transformers lets it
        if seq_len > limit:
            raise ValueError(f"seq_len {seq_len} is beyond {why}, {limit}")
        per_token = 4 * 2 * (spec.vocab_size + spec.d_model * (spec.n_layers + 1))  # float32, both models
        need = batch_size * seq_len * per_token
        if need > VERIFY_MAX_BYTES:
            raise ValueError(f"seq_len {seq_len} x batch_size {batch_size} would hold about {need / 1e9:.0f} GB of "
                             f"logits and hidden states (limit {VERIFY_MAX_BYTES / 1e9:.0f} GB); choose smaller ones")
    if save_reference is not None and not Path(save_reference).resolve().parent.is_dir():
        raise FileNotFoundError(f"save_reference: the directory of {save_reference} does not exist; create it first")


def _read_reference(path: Path, vocab: int):
    """The stored inputs, logits, hidden states and metadata of a reference file, checked."""
    from safetensors import safe_open
    from safetensors.torch import load_file

    if not path.is_file():
        raise FileNotFoundError(f"reference file {path} does not exist")
    try:
        stored = load_file(str(path))
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
    except Exception as exc:  # safetensors' errors for a torn or foreign file
        raise ValueError(f"reference file {path} is not a safetensors file ({exc})") from None
    missing = [k for k in ("input_ids", "logits") if k not in stored]
    if missing:
        raise ValueError(f"reference file {path} lacks {', '.join(missing)}; write it with save_reference")
    ids, logits = stored["input_ids"], stored["logits"]
    if ids.dim() != 2 or ids.dtype.is_floating_point or not ids.numel():
        raise ValueError(f"reference file {path}: input_ids must be a non-empty (batch, seq) tensor of token ids")
    if int(ids.min()) < 0 or int(ids.max()) >= vocab:
        raise ValueError(f"reference file {path}: input_ids hold ids outside this checkpoint's vocabulary [0, {vocab})")
    if logits.dim() != 3 or logits.shape[:2] != ids.shape:
        raise ValueError(f"reference file {path}: logits have shape {tuple(logits.shape)}, "
                         f"not (batch, seq, vocab) for input_ids of shape {tuple(ids.shape)}")
    hidden = [stored[f"hidden.{i}"] for i in range(sum(k.startswith("hidden.") for k in stored))]
    if meta.get("dtype", "float32") not in TOLERANCES:
        raise ValueError(f"reference file {path}: unknown dtype {meta['dtype']!r} in its metadata")
    fp32 = stored.get("float32_logits")
    if fp32 is not None and fp32.shape != logits.shape:
        raise ValueError(f"reference file {path}: float32_logits have shape {tuple(fp32.shape)}, not the logits' "
                         f"{tuple(logits.shape)}")
    return ids, logits, hidden, meta, fp32


def verify(
    path_or_repo_id: str | Path,
    *,
    dtype: str = "float32",
    reference: Optional[str | Path] = None,
    save_reference: Optional[str | Path] = None,
    batch_size: int = 2,
    seq_len: int = 32,
    seed: int = 0,
    revision: Optional[str] = None,
    tolerances: Optional[dict[str, float]] = None,
    fp8: str = "dequantize",
) -> Report:
    """Compare zoo with the reference on ``path_or_repo_id``; see :class:`Report`.

    ``reference=FILE`` compares against a stored reference (no transformers needed);
    ``save_reference=FILE`` stores this run's reference for later. ``fp8="keep"`` loads an FP8
    checkpoint's linear weights in FP8 (see :func:`zoo.checkpoints.from_pretrained`).
    """
    from safetensors.torch import save_file

    source = open_source(path_or_repo_id, revision=revision)
    directory, config = source.path, source.config()
    if config is None:
        raise CheckpointError(f"{directory}: zoo's own layout (spec.toml) has no HF config; transformers cannot "
                              "build it, so there is nothing to verify against")
    spec = config_to_spec(config)
    _check_verify_inputs(spec, dtype=dtype, batch_size=batch_size, seq_len=seq_len, reference=reference,
                         save_reference=save_reference)
    vocab = spec.vocab_size
    # zoo's own checks (safetensors only, never a pickle; shards inside the directory) come before
    # any reference code reads the directory.
    if directory.is_dir():
        with reading(directory):
            WeightFiles(directory).close()
    if reference is not None:
        ids, ref_logits, ref_hidden, meta, ref_fp32 = _read_reference(Path(reference), vocab)
        dtype = meta.get("dtype", dtype)
        ref_name = f"stored reference {Path(reference).name} ({meta.get('reference', 'unknown')})"
    # zoo's own checks (config, weight names and shapes) come before the reference runs.
    model = from_pretrained(directory, dtype=_dtype(dtype), fp8=fp8)
    if reference is None:
        gen = torch.Generator().manual_seed(seed)
        ids = torch.randint(0, vocab, (batch_size, seq_len), generator=gen)
        ref_logits, ref_hidden, ref_name = run_reference(directory, ids, dtype)
        # in low precision the reference's own error sets the bar: its float32 run on the same ids
        ref_fp32 = run_reference(directory, ids, "float32")[0] if dtype != "float32" else None
    if save_reference is not None:
        tensors = {"input_ids": ids.contiguous(), "logits": ref_logits.contiguous()}
        if ref_fp32 is not None:
            tensors["float32_logits"] = ref_fp32.contiguous()
        tensors.update({f"hidden.{i}": h.contiguous() for i, h in enumerate(ref_hidden)})
        save_file(tensors, str(save_reference), metadata={"dtype": dtype, "reference": ref_name,
                                                          "source": str(path_or_repo_id)})

    with torch.no_grad():
        final, hidden = model.hidden_states(ids, output_hidden_states=True)
        logits = model.logits_from_hidden(final).float()
    # transformers reports the last layer's output after the final norm.
    ours = [h.float() for h in hidden[:-1]] + [final.float()]
    deltas = [float((a - b).abs().max()) for a, b in zip(ours, ref_hidden)] if len(ours) == len(ref_hidden) else []
    rel = [d / max(float(b.abs().max()), torch.finfo(torch.float32).tiny) for d, b in zip(deltas, ref_hidden)]
    max_abs, kl, top1 = compare_logits(logits, ref_logits)
    tol, against_fp32, own = dict(TOLERANCES[dtype]), None, None
    if dtype != "float32" and ref_fp32 is not None:
        against_fp32 = dict(zip(("mean_kl", "top1"), compare_logits(logits, ref_fp32)[1:]))
        own = dict(zip(("mean_kl", "top1"), compare_logits(ref_logits, ref_fp32)[1:]))
        tol = low_precision_tolerances(dtype, own)
    return Report(
        source=str(path_or_repo_id), model_type=model.checkpoint_format, reference=ref_name, dtype=dtype,
        shape=tuple(ids.shape), params=model.num_parameters(), max_abs=max_abs, mean_kl=kl, top1=top1,
        hidden=deltas, hidden_rel=rel, tolerances={**tol, **(tolerances or {})},
        ignored=ignored_fields(config), nonfinite=nonfinite_weights(model), float32=against_fp32, reference_error=own,
    )


def nonfinite_weights(model: torch.nn.Module) -> list[str]:
    """Each parameter or buffer holding NaN or Inf, with how many of each and the first position."""
    found = []
    for name, t in list(model.named_parameters()) + list(model.named_buffers()):
        if not t.is_floating_point():
            continue
        t = t.float() if t.element_size() == 1 else t  # float8 (an FP8 checkpoint kept as stored) has no isinf
        nan, inf = int(torch.isnan(t).sum()), int(torch.isinf(t).sum())
        if nan or inf:
            first = tuple(int(i) for i in (~torch.isfinite(t)).nonzero()[0])
            found.append(f"{name}: {nan} NaN, {inf} Inf (first at {first})")
    return found

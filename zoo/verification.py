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

# Default pass criteria. fp32 must match closely; bf16 rounds every matmul, so it is judged by
# the distributions (KL, top-1), not by single logits.
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
    tolerances: dict[str, float] = field(default_factory=dict)

    @property
    def passed(self) -> bool:
        t = self.tolerances
        return self.max_abs <= t["max_abs"] and self.mean_kl <= t["mean_kl"] and self.top1 >= t["top1"]

    @property
    def worst_layer(self) -> Optional[int]:
        """The first layer whose hidden state departs (index into ``hidden``; 0 = embeddings)."""
        if not self.hidden:
            return None
        bound = self.tolerances["max_abs"] if math.isfinite(self.tolerances["max_abs"]) else None
        if bound is not None:
            for i, d in enumerate(self.hidden):
                if d > bound:
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
            lines.append("  hidden-state max |Δ|: " + ", ".join(f"{n} {d:.2e}" for n, d in zip(names, self.hidden)))
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
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        str(directory), dtype=_dtype(dtype), attn_implementation="eager"
    ).eval()
    with torch.no_grad():
        out = hf(ids, output_hidden_states=True)
    logits, hidden = out.logits.float(), [h.float() for h in out.hidden_states]
    del hf, out
    gc.collect()
    return logits, hidden, f"transformers {transformers.__version__}"


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
) -> Report:
    """Compare zoo with the reference on ``path_or_repo_id``; see :class:`Report`.

    ``reference=FILE`` compares against a stored reference (no transformers needed);
    ``save_reference=FILE`` stores this run's reference for later.
    """
    from safetensors.torch import load_file, save_file

    from zoo.checkpoints import config_to_spec, from_pretrained, read_config
    from zoo.checkpoints.hub import resolve

    directory = resolve(path_or_repo_id, revision=revision)
    config = read_config(directory)
    vocab = config_to_spec(config).vocab_size
    if reference is not None:
        stored = load_file(str(reference))
        from safetensors import safe_open

        with safe_open(str(reference), framework="pt") as f:
            meta = f.metadata() or {}
        ids, ref_logits = stored["input_ids"], stored["logits"]
        ref_hidden = [stored[f"hidden.{i}"] for i in range(sum(k.startswith("hidden.") for k in stored))]
        dtype = meta.get("dtype", dtype)
        ref_name = f"stored reference {Path(reference).name} ({meta.get('reference', 'unknown')})"
    else:
        gen = torch.Generator().manual_seed(seed)
        ids = torch.randint(0, vocab, (batch_size, seq_len), generator=gen)
        ref_logits, ref_hidden, ref_name = run_reference(directory, ids, dtype)
    if save_reference is not None:
        tensors = {"input_ids": ids.contiguous(), "logits": ref_logits.contiguous()}
        tensors.update({f"hidden.{i}": h.contiguous() for i, h in enumerate(ref_hidden)})
        save_file(tensors, str(save_reference), metadata={"dtype": dtype, "reference": ref_name,
                                                          "source": str(path_or_repo_id)})

    model = from_pretrained(directory, dtype=_dtype(dtype))
    with torch.no_grad():
        final, hidden = model.hidden_states(ids, output_hidden_states=True)
        logits = model.logits_from_hidden(final).float()
    # transformers reports the last layer's output after the final norm.
    ours = [h.float() for h in hidden[:-1]] + [final.float()]
    deltas = [float((a - b).abs().max()) for a, b in zip(ours, ref_hidden)] if len(ours) == len(ref_hidden) else []
    max_abs, kl, top1 = compare_logits(logits, ref_logits)
    return Report(
        source=str(path_or_repo_id), model_type=model.checkpoint_format, reference=ref_name, dtype=dtype,
        shape=tuple(ids.shape), params=model.num_parameters(), max_abs=max_abs, mean_kl=kl, top1=top1,
        hidden=deltas, tolerances={**TOLERANCES[dtype], **(tolerances or {})},
    )

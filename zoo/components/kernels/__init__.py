"""Fast kernels for the memory-bound parts: norms, RoPE, the GLU gated product, the loss
(Triton) and attention with soft-capping or a sliding window (FlexAttention).

Importing this package imports neither Triton nor any kernel: it registers each backend under the
registry kind ``kernel`` by import path, and :mod:`zoo.core.kernels` loads one when it is chosen.
"""

import contextlib

import torch

from zoo.core.kernels import KIND, Backend
from zoo.core.registry import manager


def on_device(t: torch.Tensor):
    """Launch kernels on ``t``'s GPU rather than the current one (a model on ``cuda:1`` while
    ``cuda:0`` is current would otherwise read foreign memory); nothing to do off CUDA."""
    return torch.cuda.device(t.device) if t.device.type == "cuda" else contextlib.nullcontext()

BACKENDS = (
    Backend("rmsnorm", "triton", "zoo.components.kernels.norms:rms_norm_module"),
    Backend("layernorm", "triton", "zoo.components.kernels.norms:layer_norm_module"),
    Backend("rope", "triton", "zoo.components.kernels.rope:rope_module"),
    Backend("glu", "triton", "zoo.components.kernels.glu:glu_module"),
    Backend("loss", "triton", "zoo.components.kernels.cross_entropy:decoder_loss", traced=True),
    Backend("attention", "flex", "zoo.components.kernels.attention:flex_attend", needs="flex", traced=True),
    Backend("scalar_decay", "triton", "zoo.components.kernels.recurrent:chunked",
            traced=True),
    Backend("gated_delta", "triton", "zoo.components.kernels.gated_deltanet:chunk_gated_delta_rule",
            traced=True),
)

for _b in BACKENDS:
    manager().add(KIND, f"{_b.component}.{_b.name}", _b)

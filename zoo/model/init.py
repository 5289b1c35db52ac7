"""Seeded initialisation of a built model: one set of weights for every layout.

Every module draws from its own generator, seeded from the model's seed and the module's name
(:func:`init_seed`), on the whole of each parameter, so a model sharded by FSDP2, TP or EP starts
from the weights one process builds with the same seed.
"""

from __future__ import annotations

import contextlib
import hashlib
import inspect
from typing import Optional

import torch
from torch import nn

from zoo.core import kinds as _kinds


@torch.no_grad()
def init_weights(model: nn.Module, generator: Optional[torch.Generator] = None, *, seed: Optional[int] = None) -> None:
    """Normal(0, init_std) for matrices and embeddings, zeros for biases; parts with their own
    rule (norms, learned scales, experts) implement ``reset_parameters``. Matrices, embeddings and
    the torch modules inside parts (a ``Conv1d``, with its own ``reset_parameters``) come first;
    then each part's ``reset_parameters``, inner parts before the parts holding them, so that a
    part's own initialisation is final.

    Every module draws from its own generator, seeded from ``seed`` and the module's name
    (:func:`init_seed`), on the whole of each parameter: a model sharded by FSDP2 (DTensor
    parameters) gets each whole parameter of one module at a time, initialised as one process
    initialises it, and keeps its shard. So the weights are the same whatever the layout.
    ``reset_parameters`` is called with ``generator=`` and ``std=`` when it takes them; one that
    does not (a plugin's) runs with the global RNG seeded the same way. Without ``seed``, it
    is drawn from ``generator`` (or the global RNG)."""
    if seed is None:
        device = generator.device if generator is not None else "cpu"
        seed = int(torch.randint(0, 2**62, (), generator=generator, device=device))
    std = model.spec.init_std
    plain, parts = [], []
    for name, module in model.named_modules():
        (parts if module is not model and _kinds.is_part(module) else plain).append((name, module))
    for name, module in plain + parts[::-1]:
        takes = _init_keywords(module)
        if not isinstance(module, (nn.Linear, nn.Embedding)) and takes is None and module is not model:
            continue
        tensors = [t for t in (*module.parameters(recurse=False), *module.buffers(recurse=False))]
        device = tensors[0].device if tensors else torch.device("cpu")
        seeded = init_seed(seed, module_name(name))
        gen = torch.Generator(device=device).manual_seed(seeded)
        with _whole_parameters(module):
            if module is model:
                if model.head_bias is not None:
                    model.head_bias.zero_()
            elif isinstance(module, (nn.Linear, nn.Embedding)):
                module.weight.normal_(0.0, std, generator=gen)
                if getattr(module, "bias", None) is not None:
                    module.bias.zero_()
            elif "generator" in takes:
                module.reset_parameters(generator=gen, **({"std": std} if "std" in takes else {}))
            else:  # a part that draws from the global RNG, if at all: seed it the same way
                with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
                    torch.manual_seed(seeded)
                    module.reset_parameters()


def init_seed(seed: int, name: str) -> int:
    """The seed of the generator that initialises module ``name`` (a dotted name in the model, as
    ``named_modules`` gives it) of a model built with ``seed``."""
    digest = hashlib.blake2b(f"{seed}:{name}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & (2**63 - 1)


# Names that wrappers (activation checkpointing, torch.compile, FSDP1) insert between a module and its parts.
_WRAPPER_NAMES = ("_checkpoint_wrapped_module", "_orig_mod", "_fsdp_wrapped_module")


def module_name(name: str) -> str:
    """A module's dotted name in the model, less the names wrappers insert."""
    return ".".join(p for p in name.split(".") if p not in _WRAPPER_NAMES)


def _init_keywords(module: nn.Module) -> Optional[frozenset[str]]:
    """The keywords a module's ``reset_parameters`` takes (None: it has none)."""
    fn = getattr(module, "reset_parameters", None)
    if not callable(fn):
        return None
    return frozenset(inspect.signature(fn).parameters)


@contextlib.contextmanager
def _whole_parameters(module: nn.Module):
    """Within the block, the module's own sharded (DTensor) parameters are whole plain tensors;
    after it, each process keeps its shard of what they were set to. Every process computes the
    same whole tensors, so taking the local shard needs no communication. At most one module's
    own parameters are whole at a time."""
    from torch.distributed.tensor import DTensor, distribute_tensor  # importing it costs half a second

    sharded = {n: p for n, p in module._parameters.items() if isinstance(p, DTensor)}
    for n, p in sharded.items():
        module._parameters[n] = nn.Parameter(torch.empty(p.shape, dtype=p.dtype, device=p.to_local().device),
                                             requires_grad=p.requires_grad)
    try:
        yield
        for n, p in sharded.items():
            shard = distribute_tensor(module._parameters[n].detach(), p.device_mesh, p.placements, src_data_rank=None)
            p.to_local().copy_(shard.to_local())
    finally:
        for n, p in sharded.items():
            module._parameters[n] = p


@contextlib.contextmanager
def no_default_init():
    """Skip torch's own initialisation of Linear and Embedding while building on the meta device.

    Those random inits are thrown away (``init_weights`` or a checkpoint fills the weights), and on
    meta tensors they cost over a second the first time in a process (torch imports its Python
    decompositions for them), which would dominate building even the largest preset.
    """
    saved = nn.Linear.reset_parameters, nn.Embedding.reset_parameters
    nn.Linear.reset_parameters = nn.Embedding.reset_parameters = lambda self: None
    try:
        yield
    finally:
        nn.Linear.reset_parameters, nn.Embedding.reset_parameters = saved

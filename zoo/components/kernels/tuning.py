"""Launch configurations chosen by shape, autotuned among on a GPU.

A call site names the configurations (``(num_warps, num_stages)`` pairs) it may launch with for
its block sizes: each one is compiled for sm_90 by ``tests/kernels/test_kernels_fit.py``, which checks
that it fits the block's shared memory. On a GPU :func:`launch` lets Triton's autotuner time them
once per kernel, configuration list, block sizes and dtypes; elsewhere (the interpreter) the first
one runs. Only kernels that do not read what they write are launched this way (the autotuner
runs each candidate on the real arguments).
"""

import contextlib

import torch
import triton

_every = False
_tuners: dict = {}


def launch(kernel, grid, configs, *args, **meta):
    """``kernel[grid](*args, **meta)`` with the best of ``configs``."""
    if _every:  # fit.py: record the launch once per configuration
        for warps, stages in configs:
            kernel[grid](*args, **meta, num_warps=warps, num_stages=stages)
        return
    on_gpu = any(torch.is_tensor(a) and a.is_cuda for a in args)
    if len(configs) == 1 or not on_gpu:
        warps, stages = configs[0]
        kernel[grid](*args, **meta, num_warps=warps, num_stages=stages)
        return
    key = (kernel, tuple(configs), tuple(sorted(meta.items())), tuple(a.dtype for a in args if torch.is_tensor(a)))
    if key not in _tuners:
        _tuners[key] = triton.autotune([triton.Config({}, num_warps=w, num_stages=s) for w, s in configs], key=[])(kernel)
    _tuners[key][grid](*args, **meta)


@contextlib.contextmanager
def every_config():
    """Inside, :func:`launch` launches every configuration in turn (for recording, not running)."""
    global _every
    _every = True
    try:
        yield
    finally:
        _every = False

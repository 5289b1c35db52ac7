"""The MoE dispatch as it runs on a GPU: the grouped-matmul path reads nothing back to the host in
the forward (a host read is a device sync), and its availability is probed per device and dtype."""

import pytest
import torch

from test_conformance import D_MOE as D, moe  # the shared MoE helpers
from zoo.components.ffn import moe as moe_module
from zoo.core.context import ForwardContext


def no_host_reads(monkeypatch):
    def refuse(self, *a, **k):
        raise AssertionError("the forward read a tensor back to the host")

    for name in ("item", "tolist", "__int__", "__float__", "__bool__"):
        monkeypatch.setattr(torch.Tensor, name, refuse)


@pytest.mark.skipif(not moe_module._grouped_mm_ok(torch.device("cpu"), torch.float32),
                    reason="torch._grouped_mm does not run on this CPU")
def test_the_grouped_forward_with_a_capacity_factor_reads_nothing_back(monkeypatch):
    capped = moe(capacity_factor=0.5, dispatch="grouped")
    x = torch.randn(1, 16, D)
    ctx = ForwardContext(position_ids=torch.arange(16)[None], slots=torch.arange(16))
    with monkeypatch.context() as m:
        no_host_reads(m)
        y = capped(x, ctx)
    assert y.shape == x.shape and 0 < float(ctx.metrics["moe_dropped"]) < 1


def test_the_grouped_path_is_probed_per_device_and_dtype(monkeypatch):
    """The probe's cache key is the tensor's device (cuda:0 and cuda:1 may be different GPUs), not
    its type."""
    asked = []
    monkeypatch.setattr(moe_module, "_grouped_mm_ok", lambda device, dtype: asked.append((device, dtype)) or False)
    moe()(torch.randn(1, 4, D))
    assert asked == [(torch.device("cpu"), torch.float32)]

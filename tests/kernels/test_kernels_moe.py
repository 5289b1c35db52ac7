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


def test_under_autocast_the_grouped_path_is_chosen_and_run_for_the_autocast_dtype(monkeypatch):
    """bf16 autocast over float32 weights and activations: the probe is asked for bfloat16 (not the
    float32 the tokens arrive in), and the grouped product runs in bf16, as F.linear would."""
    asked, ran = [], []
    monkeypatch.setattr(moe_module, "_grouped_mm_ok", lambda device, dtype: asked.append(dtype) or True)
    real = moe_module._experts_grouped
    monkeypatch.setattr(moe_module, "_experts_grouped",
                        lambda xs, counts, *w, **k: ran.append((xs.dtype, w[1].dtype)) or real(xs, counts, *w, **k))
    m, x = moe(), torch.randn(1, 8, D)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = m(x)
    assert asked == [torch.bfloat16] and ran == [(torch.bfloat16, torch.bfloat16)]
    assert y.dtype == torch.float32 and y.isfinite().all()


def test_the_path_and_its_reason_per_device_and_dtype():
    m = moe()  # d_model 32, d_ff 16: 16-byte multiples in float32 and bfloat16
    assert m.experts.choose_path(torch.device("cpu"), torch.float32)[0] == ("grouped" if hasattr(torch, "_grouped_mm")
                                                                          else "loop")
    assert moe(d_ff=6).experts.choose_path(torch.device("cpu"), torch.bfloat16) == \
        ("loop", "d_model 32 and d_ff 6 in bfloat16 are not all multiples of 16 bytes")
    assert moe(dispatch="loop").experts.choose_path(torch.device("cpu"), torch.float32) == \
        ("loop", "dispatch = 'loop' in the spec")
    if not torch.cuda.is_available():
        assert m.experts.choose_path(torch.device("cuda"), torch.bfloat16) == \
            ("unprobed", "no CUDA device here to probe torch._grouped_mm for bfloat16")


def test_describe_backends_reports_the_experts_path(capsys):
    from zoo.cli import main

    assert main(["describe", "qwen3-30b-a3b", "--backends", "cpu", "--dtype", "fp32"]) == 0
    rows = [line.split(None, 4) for line in capsys.readouterr().out.splitlines() if line.split()[:2] == ["experts", "GroupedExperts"]]
    want = ("grouped", "torch._grouped_mm on cpu, float32") if hasattr(torch, "_grouped_mm") else None
    assert [r[:3] for r in rows] == [["experts", "GroupedExperts", "48"]]
    if want:
        assert tuple(r[3:] for r in rows)[0] == list(want)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_on_cuda_under_autocast_the_grouped_forward_reads_nothing_back(monkeypatch):
    """On a GPU, bf16 autocast over float32 weights: the experts take torch._grouped_mm (where it runs
    for bf16) and the forward reads nothing back to the host; its output is within bf16's error of
    the loop path under the same autocast."""
    m = moe(d_ff=64).cuda()
    path, why = m.experts.choose_path(torch.device("cuda"), torch.bfloat16)
    if path != "grouped":
        pytest.skip(why)
    x = torch.randn(2, 64, D, device="cuda")
    with torch.autocast("cuda", dtype=torch.bfloat16):
        want = moe(d_ff=64, dispatch="loop").cuda()(x)
        with monkeypatch.context() as patched:
            no_host_reads(patched)
            got = m(x)
    assert got.dtype == torch.float32
    assert (got - want).norm() / want.norm() < 2**-6

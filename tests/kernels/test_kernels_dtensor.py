"""The Triton kernels under tensor and sequence parallelism (tp = 2, torchrun on two CPU processes, gloo,
``TRITON_INTERPRET=1``), where norms meet DTensors: the loss and every gradient with every kernel
forced equal those of the reference path in the same layout (itself checked against one process in
tests/train/test_tensor_parallel.py). The norms run on each process's rows (as ``local_map`` would),
the GLU as it is (its input reaches only its own projections); the loss is vocabulary-parallel under
TP and never asks for the fused kernel. A kernel without a rule for DTensors (RoPE given one, the
fused loss asked about a sharded head) steps aside to the reference path and says so once.

Tolerances: both paths compute in float32 and differ in rounding order only (tests/kernels/test_kernels.py):
1e-5 relative, plus 1e-6 of each tensor's largest magnitude."""

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("triton")

SCRIPT = r'''import json, sys, warnings
import torch
import torch.distributed as dist
from accelerate import Accelerator
from torch.distributed.tensor import DTensor, Replicate
from zoo.core import kernels
from zoo.components.kernels import glu, norms
from zoo.core.spec import ModelSpec
from zoo.testing import one_of_each
from zoo.training.config import ParallelConfig
from zoo.training.loop import start_model

acc = Accelerator(cpu=True)
out, names = sys.argv[1], json.loads(sys.argv[2])
calls = {"rms_norm": 0, "layer_norm": 0, "gated_product": 0}
for module, name in ((norms, "rms_norm"), (norms, "layer_norm"), (glu, "gated_product")):
    def counted(*a, _f=getattr(module, name), _n=name, **k):
        calls[_n] += 1
        return _f(*a, **k)
    setattr(module, name, counted)


def spec(name):
    if not name.endswith("+layernorm"):
        return one_of_each(name, vocab_size=256)
    data = one_of_each(name.removesuffix("+layernorm"), vocab_size=256).to_dict()
    data["final_norm"] = {"name": "layernorm"}
    for layer in data["layers"].values():
        layer["norm"] = {"name": "layernorm"}
    return ModelSpec.from_dict(data)


batch = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
report = {}
for name in names:
    net = start_model(spec(name), acc, seed=5, sharded=False, parallel=ParallelConfig(tp=2))
    entry = report[name] = {}
    for setting in ("triton", "off"):
        for k in calls:
            calls[k] = 0
        with warnings.catch_warnings(record=True) as seen, kernels.using(setting):
            warnings.simplefilter("always")
            loss = net(batch, labels=batch).loss
            loss.backward()
        grads = {k: (p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad).tolist()
                 for k, p in net.named_parameters()}
        net.zero_grad()
        entry[setting] = {"loss": loss.item(), "grads": grads, "calls": dict(calls),
                          "messages": [str(w.message) for w in seen if issubclass(w.category, RuntimeWarning)]}
# A part without a rule for DTensors steps aside: the RoPE kernel given a DTensor, the fused loss
# asked about the TP model, whose head is sharded (its loss under TP is vocabulary-parallel and never
# asks).
rope = next(iter(net.positions.values()))
with warnings.catch_warnings(record=True) as seen, kernels.using("triton"):
    warnings.simplefilter("always")
    mesh = next(p for p in net.parameters() if isinstance(p, DTensor)).device_mesh
    q = DTensor.from_local(torch.zeros(2, 4, 8, 16), mesh, [Replicate()])
    report["aside"] = {"rope": kernels.fast(rope, q) is None, "loss": kernels.fast(net, torch.zeros(2, 16)) is None,
                       "messages": [str(w.message) for w in seen if issubclass(w.category, RuntimeWarning)]}
if dist.get_rank() == 0:
    with open(out, "w") as f:
        json.dump(report, f)
'''


@pytest.mark.slow
def test_kernels_under_tensor_parallelism_give_the_reference_values(tmp_path):
    import torch

    path, out = tmp_path / "tp.py", tmp_path / "report.json"
    path.write_text(SCRIPT)
    # RMSNorm and SwiGLU; OLMo 2's QK-norm over the whole projection (gathered first); LayerNorm
    names = ["llama3-8b", "olmo2-7b", "llama3-8b+layernorm"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TRITON_INTERPRET": "1", "TOKENIZERS_PARALLELISM": "false"}
    env.pop("ZOO_KERNELS", None)
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                           str(path), str(out), json.dumps(names)], capture_output=True, text=True, timeout=1200, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads(out.read_text())
    for name in names:
        fast, ref = report[name]["triton"], report[name]["off"]
        norm = "layer_norm" if name.endswith("layernorm") else "rms_norm"
        assert fast["calls"][norm] > 0 and fast["calls"]["gated_product"] > 0, (name, fast["calls"])
        assert not any(ref["calls"].values()), ref["calls"]
        torch.testing.assert_close(fast["loss"], ref["loss"], rtol=1e-5, atol=0)
        assert fast["grads"].keys() == ref["grads"].keys()
        for k in ref["grads"]:
            a, b = torch.tensor(fast["grads"][k]), torch.tensor(ref["grads"][k])
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6 * max(1.0, float(b.abs().max())), msg=f"{name} {k}")
        assert ref["messages"] == []
        assert fast["messages"] == []  # nothing stepped aside
    aside = report["aside"]
    assert aside["rope"] and aside["loss"], aside
    assert len(aside["messages"]) == 2, aside["messages"]
    assert "(rope): the triton kernel takes plain tensors and its input is a DTensor" in aside["messages"][0]
    assert aside["messages"][1].startswith("Decoder (loss): the triton kernel takes plain tensors and it reads a "
                                           "tensor that is sharded"), aside["messages"]

"""A new part of an existing kind is one file plus one test: the ScaleNorm of tests/scalenorm_plugin.py
(one class, its plan one dict) passes the conformance suite, and a model whose every norm it is gives,
at tp = 2 (torchrun, two CPU processes, gloo), the one-process loss and every gradient, and the
one-process initial weights. Tolerances: those of tests/train/test_tensor_parallel.py (in units of the
one-process float32 run's own error against float64)."""

from pathlib import Path

import pytest

import zoo
from zoo.testing import check_plugin

from parallel_check import HELPERS, assert_loss_and_gradients_match, launch

pytestmark = pytest.mark.usefixtures("one_thread")

SCRIPT = '''import json, sys
sys.path.insert(0, json.loads(sys.argv[3]))  # where the plugin's one file is
import torch
import torch.distributed as dist
import zoo
from accelerate import Accelerator
from torch.distributed.tensor import DTensor
from zoo.training.checkpointer import full_state_dict
from zoo.training.config import ParallelConfig
from zoo.training.loop import clip_grad_norm, start_model

assert zoo.load_plugin("scalenorm_plugin").error is None
acc = Accelerator(cpu=True)
out, spec = sys.argv[1], json.loads(sys.argv[2])
rank, world = dist.get_rank(), dist.get_world_size()
gen = torch.Generator().manual_seed(0)
batches = [torch.randint(0, 256, (4, 16), generator=gen)]
''' + HELPERS + '''
report = compare_layouts({"tp2": ["scalenorm"]}, {"tp2": {"tp": 2, "dp_shard": 1, "fsdp": False}},
                         {"scalenorm": lambda: zoo.get_spec(spec)})
if rank == 0:
    json.dump(report, open(out, "w"))
'''

SPEC = {"vocab_size": 256, "d_model": 32, "n_layers": 2, "max_seq_len": 64, "position": "rope",
        "final_norm": "scalenorm_example",
        "layers": {"default": {"norm": "scalenorm_example", "ffn": {"name": "swiglu", "d_ff": 64},
                               "mixer": {"name": "attention", "n_heads": 4, "n_kv_heads": 2, "qk_norm": "head"}}}}


def test_a_new_norm_in_one_file_passes_the_conformance_suite():
    assert ("norm", "scalenorm_example") in check_plugin("scalenorm_plugin")


def test_a_new_norm_in_one_file_shards_at_tp_2_as_one_process_computes(tmp_path):
    assert zoo.load_plugin("scalenorm_plugin").error is None
    spec = zoo.get_spec(SPEC)
    assert {type(m).__name__ for m in zoo.build_model(spec).modules()} >= {"ScaleNorm"}
    report = launch(tmp_path, "scalenorm_tp", SCRIPT, SPEC, str(Path(__file__).parents[1]), processes=2)
    entry = report["parts"]["tp2"]["scalenorm"]
    assert "error" not in entry, entry
    assert_loss_and_gradients_match(entry, "tp2 scalenorm")
    assert entry["init_keys"] and entry["init_differ"] == [], entry

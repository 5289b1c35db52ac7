"""Memory per device before a launch (``zoo describe --parallel``, ``zoo.tools.memory.plan``): the parameter
shard each process is told it holds is the one it holds after ``start_model`` shards the model (a torchrun
launch of four CPU processes, gloo), and the activation bytes each block's parts report per token are
within 10% of what ``torch.autograd.graph.saved_tensors_hooks`` counts on a real forward (fp32 and bf16,
tiny models of real-ish width: d_model 512, heads of 64; the recurrent mixers' chunked forms on the CPU,
crossing chunks; DSA beyond its top-k)."""

import collections
import json
import os
import subprocess
import sys

import pytest
import torch

from zoo.core.kinds import is_part
from zoo.core.spec import ModelSpec
from zoo.model.decoder import build_model
from zoo.testing import one_of_each
from zoo.tools.memory import chunk_rows, coordinates, parse_layout, plan
from zoo.training.config import ParallelConfig

pytestmark = pytest.mark.usefixtures("one_thread")

WIDE = dict(d_model=512, head_dim=64, d_ff=1024, vocab_size=1024)


def wide(name):
    if name == "linear-attention":  # RetNet's decays, elu + 1 and the sum normaliser
        data = one_of_each("llama3-8b", **WIDE).to_dict()
        data["layers"]["default"]["mixer"] = {"name": "linear_attention", "n_heads": 4, "head_dim": 64,
                                              "feature_map": "elu1", "decay": "retnet", "normalize": "sum", "chunk": 16}
        return ModelSpec.from_dict(data)
    data = one_of_each(name, **WIDE).to_dict()
    data["mtp"] = None
    return ModelSpec.from_dict(data)


def saved_bytes(model, ids):
    """Bytes autograd saves during ``model.loss(ids, ids)``, by the innermost zoo part running when a
    storage is first saved; parameters, buffers and the position tables every layer shares left out."""
    skip = {t.untyped_storage().data_ptr() for t in (*model.parameters(), *model.buffers())}
    stack, seen, by = ["model"], set(), collections.Counter()

    def enter(module, args, name):
        stack.append(name)
        pos = args[2] if len(args) > 2 else None
        if pos is not None and isinstance(pos.state, tuple):  # RoPE's cos and sin, made once per forward
            skip.update(t.untyped_storage().data_ptr() for t in pos.state if torch.is_tensor(t))

    def leave(module, args, out):
        stack.pop()

    hooks = []
    for name, m in model.named_modules():
        if m is not model and is_part(m):
            hooks.append(m.register_forward_pre_hook(lambda mod, a, name=name: enter(mod, a, name)))
            hooks.append(m.register_forward_hook(leave))

    def pack(t):
        st = t.untyped_storage()
        key = st.data_ptr()
        if key not in skip and key not in seen and st.nbytes():
            seen.add(key)
            by[stack[-1]] += st.nbytes()
        return t

    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            model.loss(ids, ids)
    finally:
        for h in hooks:
            h.remove()
    return by


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("name", ["llama3-8b", "gemma2-2b", "deepseek-v3", "qwen3-30b-a3b", "mamba2-2.7b",
                                  "nemotron-h-8b", "qwen3-next-80b-a3b", "minimax-text-01", "linear-attention",
                                  "deepseek-v3.2-exp", "glm-5"])
def test_activation_bytes_per_token_and_layer_match_saved_tensors(name, dtype):
    T = 256  # longer than gemma2's window (4 after shrinking); its eager path keeps scores per key
    model = build_model(wide(name), seed=0).to(dtype).train()
    ids = torch.randint(0, WIDE["vocab_size"], (2, T), generator=torch.Generator().manual_seed(0))
    by = saved_bytes(model, ids)
    tokens = ids.numel()
    for i, layer in enumerate(model.layers):
        measured = sum(v for k, v in by.items() if k == f"layers.{i}" or k.startswith(f"layers.{i}.")) / tokens
        reported = layer.activation_bytes(T, dtype, device="cpu")
        assert measured > 0
        assert abs(reported - measured) <= 0.1 * measured, (name, i, reported, measured, dict(by))
    # The head and the loss: what the plan counts beyond the blocks (the final norm's, the logits').
    figures = plan(wide(name), "dp_shard=1", seq_len=T, micro_batch=2, dtype=dtype, device="cpu")
    rest = sum(v for k, v in by.items() if not k.startswith("layers."))
    assert abs(figures["bytes"]["logits"] - rest) <= 0.1 * rest, (figures["bytes"]["logits"], rest)
    total = sum(by.values())
    assert abs(figures["bytes"]["activations"] + figures["bytes"]["logits"] - total) <= 0.1 * total


def test_checkpointed_blocks_keep_their_input_and_one_is_recomputed():
    spec = wide("llama3-8b")
    full = plan(spec, ParallelConfig(dp_shard=1), seq_len=128, micro_batch=4, device="cpu")
    ac = plan(spec, ParallelConfig(dp_shard=1, ac="block"), seq_len=128, micro_batch=4, device="cpu")
    per = full["activation_bytes_per_token"]
    tokens = 4 * 128
    assert full["bytes"]["activations"] == pytest.approx(sum(per) * tokens)
    assert ac["activations_kept"] == pytest.approx(len(per) * 512 * 2 * tokens)  # bf16 inputs of d_model
    assert ac["activations_recomputed"] == pytest.approx(max(per) * tokens)


def test_layout_errors_name_what_to_change():
    with pytest.raises(ValueError, match="NAME=SIZE"):
        parse_layout("shards=4")
    with pytest.raises(ValueError, match="integer"):
        parse_layout("tp=two")
    with pytest.raises(ValueError, match="--processes"):
        plan(wide("llama3-8b"), "tp=2", seq_len=16)
    with pytest.raises(ValueError, match="ep=3.*experts"):
        plan(wide("qwen3-30b-a3b"), "dp_shard=1,ep=3", seq_len=16)
    with pytest.raises(NotImplementedError, match="n_heads"):
        plan(wide("llama3-8b"), "dp_shard=1,tp=8", seq_len=16)  # 4 heads do not split over 8


def test_expert_parallelism_splits_the_experts_then_fsdp_the_rest():
    """EP follows the spec (the experts split over ep, FSDP2 over dp_shard; the dense parameters over
    dp_shard x ep): counted against the parameter numbers directly."""
    spec = wide("qwen3-30b-a3b")
    model = build_model(spec, device="meta")
    experts = sum(p.numel() for n, p in model.named_parameters() if n.rsplit(".", 1)[-1] in ("w_gate", "w_up", "w_down"))
    dense = sum(p.numel() for p in model.parameters()) - experts
    got = plan(spec, "dp_shard=2,ep=4", seq_len=16)
    assert got["local_parameters"] == pytest.approx(experts / 8 + dense / 8, rel=0.01)
    one = plan(spec, "dp_shard=1", seq_len=16)
    assert one["local_parameters"] == experts + dense
    # one expert per process, fewer than the 4 FSDP2 shards: the experts split by their rows (dim 1)
    thin = plan(spec, "dp_shard=4,ep=8", seq_len=16, rank=5)
    assert thin["local_parameters"] == pytest.approx(experts / 32 + dense / 32, rel=0.01)


def test_in_flight_under_expert_parallelism_counts_the_experts_as_their_own_unit():
    """FSDP2 gathers the running block (its own unit and, inside it, its experts' unit) and prefetches the
    next block's own unit: under EP without that block's experts; each unit is reduce-scattered apart."""
    spec = wide("qwen3-30b-a3b")
    layer = build_model(spec, device="meta").layers[0]
    X = sum(p.numel() for n, p in layer.named_parameters() if ".experts." in n)
    D = sum(p.numel() for p in layer.parameters()) - X
    ep = plan(spec, "dp_shard=2,ep=4", seq_len=16)["in_flight_parts"]
    assert ep["blocks"] == 2 * (D + X // 4) + 2 * D  # bf16
    assert ep["block_gradient"] == 2 * (D + X // 4) + 4 * max(D, X // 4)
    fsdp = plan(spec, "dp_shard=8", seq_len=16)["in_flight_parts"]  # the experts inside the block's unit
    assert fsdp["blocks"] == 2 * 2 * (D + X) and fsdp["block_gradient"] == (2 + 4) * (D + X)


def test_chunks_and_coordinates():
    assert [chunk_rows(10, 4, i) for i in range(4)] == [3, 3, 3, 1]
    assert [chunk_rows(2, 4, i) for i in range(4)] == [1, 1, 0, 0]
    assert coordinates({"dp_replicate": 1, "dp_shard": 2, "ep": 1, "tp": 2}, 3) == \
        {"dp_replicate": 0, "dp_shard": 1, "ep": 0, "tp": 1}


SCRIPT = '''import json, sys
import torch
import torch.distributed as dist
from accelerate import Accelerator
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor
from zoo.core.spec import ModelSpec
from zoo.testing import one_of_each
from zoo.training.config import ParallelConfig
from zoo.training.loop import start_model

acc = Accelerator(cpu=True)
out, cases = sys.argv[1], json.loads(sys.argv[2])
rank = dist.get_rank()
got = {}


def local(p):
    return p.to_local() if isinstance(p, DTensor) else p


def units(net):
    """FSDP2's units as the trainer wrapped them: name -> the elements each gathers here (its own parameters unsharded)."""
    found = {}
    for name, m in net.named_modules():
        if isinstance(m, FSDPModule):
            inner = {id(p) for c in m.modules() if c is not m and isinstance(c, FSDPModule) for p in c.parameters()}
            names = [n for n, p in m.named_parameters() if id(p) not in inner]
            m.unshard()
            found[name or "root"] = sum(local(m.get_parameter(n)).numel() for n in names)
            m.reshard()
    return found


for key, (spec, layout) in cases.items():
    spec = ModelSpec.from_dict(spec)
    parallel = ParallelConfig(**layout)
    sharded = parallel.dp_shard > 1 or parallel.dp_replicate > 1 or parallel.ep > 1
    net = start_model(spec, acc, seed=0, sharded=sharded, parallel=parallel)
    got[key] = {"held": sum(local(p).numel() for p in net.parameters()), "units": units(net)}
with open(f"{out}.{rank}", "w") as f:
    json.dump(got, f)
'''


def _tiny(name, dense_only=False, **sizes):
    data = one_of_each(name, vocab_size=250, **sizes).to_dict()  # 250 rows: uneven FSDP2 chunks over 4
    if dense_only:  # MLA on dense layers
        data.update(mtp=None, layer_pattern=["dense", "dense"])
        data["layers"].pop("moe")
    if name == "deepseek-v3":  # no multi-token prediction: it has no tensor-parallel plan
        data["mtp"] = None
    return data


CASES = {
    "llama3 fsdp4": (_tiny("llama3-8b"), {"dp_shard": 4}),
    "llama3 fsdp2 x tp2": (_tiny("llama3-8b"), {"dp_shard": 2, "tp": 2}),
    "llama3 tp2 x2": (_tiny("llama3-8b"), {"dp_replicate": 2, "dp_shard": 1, "tp": 2}),
    "gemma2 fsdp2 x tp2": (_tiny("gemma2-2b"), {"dp_shard": 2, "tp": 2}),
    "deepseek-v3 mla fsdp2 x tp2": (_tiny("deepseek-v3", dense_only=True), {"dp_shard": 2, "tp": 2}),
    "deepseek-v3 fsdp4": (_tiny("deepseek-v3"), {"dp_shard": 4}),
    "qwen3-moe hsdp 2 x 2": (_tiny("qwen3-30b-a3b"), {"dp_replicate": 2, "dp_shard": 2}),
    "qwen3-moe fsdp2 x ep2": (_tiny("qwen3-30b-a3b"), {"dp_shard": 2, "ep": 2}),
    "qwen3-moe ep4": (_tiny("qwen3-30b-a3b"), {"dp_shard": 1, "ep": 4}),
    "qwen3-moe tp2 x2": (_tiny("qwen3-30b-a3b"), {"dp_replicate": 2, "dp_shard": 1, "tp": 2}),
    "deepseek-v3 fsdp2 x tp2": (_tiny("deepseek-v3"), {"dp_shard": 2, "tp": 2}),
    "deepseek-v3 tp2 x ep2": (_tiny("deepseek-v3"), {"dp_shard": 1, "ep": 2, "tp": 2}),
    "nemotron-h mamba2 fsdp2 x tp2": (_tiny("nemotron-h-8b"), {"dp_shard": 2, "tp": 2}),
    "mamba2 tp4": (_tiny("mamba2-2.7b"), {"dp_shard": 1, "tp": 4}),
}


def test_parameter_shards_equal_what_each_process_holds(tmp_path):
    script, out = tmp_path / "shards.py", tmp_path / "shards"
    script.write_text(SCRIPT)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "4", str(script),
           str(out), json.dumps(CASES)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    for rank in range(4):
        held = json.loads((tmp_path / f"shards.{rank}").read_text())
        for key, (spec, layout) in CASES.items():
            told = plan(ModelSpec.from_dict(spec), parse_layout(",".join(f"{k}={v}" for k, v in layout.items())),
                        seq_len=16, rank=rank)
            assert told["local_parameters"] == held[key]["held"], (key, rank, told["local_parameters"], held[key])
            assert told["bytes"]["parameters"] == 4 * held[key]["held"]
            # the FSDP2 units the in-flight row counts are the trainer's, each gathering what the plan says
            # (under EP each MoE's experts are a unit of their own, apart from their block's)
            if told["fsdp"]:
                assert told["units"] == held[key]["units"], (key, rank, told["units"], held[key]["units"])


def test_describe_parallel_prints_the_plan(capsys):
    from zoo.cli import main

    assert main(["describe", "llama3.2-1b", "--parallel", "dp_shard=2,tp=2", "--seq-len", "128", "--ac", "block",
                 "--json"]) == 0
    got = json.loads(capsys.readouterr().out)
    want = plan("llama3.2-1b", ParallelConfig(dp_shard=2, tp=2, ac="block"), seq_len=128)
    assert got["bytes"] == want["bytes"] and got["local_parameters"] == want["local_parameters"]
    assert main(["describe", "llama3.2-1b", "--parallel", "dp_shard=2,tp=2", "--seq-len", "128"]) == 0
    text = capsys.readouterr().out
    for row in ("parameters (fp32 shard)", "in flight", "activations", "logits and loss", "total"):
        assert row in text


@pytest.mark.parametrize("path", sorted((__import__("pathlib").Path(__file__).parents[2] / "examples" / "accelerate")
                                        .glob("fsdp2-*nodes-*.yaml")), ids=lambda p: p.name)
def test_multi_node_accelerate_configs_load_and_their_layouts_fit(path):
    import re

    from accelerate.commands.config.config_args import load_config_from_file

    config = load_config_from_file(str(path))
    assert config.distributed_type == "FSDP" and config.fsdp_config["fsdp_version"] == 2
    assert config.num_machines > 1 and config.num_processes == 8 * config.num_machines
    layouts = re.findall(r"--parallel (\S+)", path.read_text())
    assert layouts
    for layout in layouts:  # the layout each file's comment sizes fills its processes
        ParallelConfig(**{k: int(v) for k, v in (kv.split("=") for kv in layout.split(","))}).sizes(config.num_processes)

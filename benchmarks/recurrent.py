"""Recurrent hybrids: zoo against transformers' pure-torch path on the CPU, side by side in one
process, on the same weights (a random checkpoint saved by transformers), dtype and threads.
Prints ratios; absolute times on a shared machine are noise.

    python benchmarks/recurrent.py                      # every case, float32, 1 thread
    python benchmarks/recurrent.py --case qwen3_next --prefill 4096 --contexts 512 1024 2048 4096

Each case is a function ``case(args) -> (name, hf_config)`` in CASES; the runner measures:
  prefill   one forward over ``--prefill`` tokens (batch 1), best of ``--repeat`` interleaved runs;
  decode    tokens/s of ``--steps`` single-token steps onto a state prefilled to each context length
            (zoo's decode state, transformers' cache), best of ``--repeat``.
Times are the process's CPU time (``time.process_time``; with one thread, the work done), which a
machine shared with other jobs disturbs far less than wall time; ``--clock wall`` measures wall time.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch


def qwen3_next_case(args):
    """A small Qwen3-Next: 8 layers, 3 Gated DeltaNet : 1 gated attention, MoE of 8 experts (top 2)
    with a gated shared expert in every layer, d_model 256."""
    return "qwen3_next", dict(
        model_type="qwen3_next", vocab_size=4096, hidden_size=256, num_hidden_layers=8, num_attention_heads=4,
        num_key_value_heads=2, head_dim=64, partial_rotary_factor=0.25, linear_num_value_heads=8,
        linear_num_key_heads=4, linear_key_head_dim=32, linear_value_head_dim=32, linear_conv_kernel_dim=4,
        num_experts=8, num_experts_per_tok=2, moe_intermediate_size=128, shared_expert_intermediate_size=128,
        intermediate_size=512, max_position_embeddings=32768, tie_word_embeddings=False,
    )


CASES = {"qwen3_next": qwen3_next_case}


CLOCK = time.process_time


def best(fn, repeat):
    times = []
    for _ in range(repeat):
        t = CLOCK()
        fn()
        times.append(CLOCK() - t)
    return min(times)


def run_case(make, args) -> dict:
    import transformers

    import zoo

    name, cfg = make(args)
    cfg = dict(cfg)
    model_type = cfg.pop("model_type")
    with tempfile.TemporaryDirectory() as d:
        torch.manual_seed(0)
        hf = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(model_type, **cfg),
                                                           dtype=torch.float32).eval()
        hf.save_pretrained(d)
        model = zoo.from_pretrained(d).eval()
    ids = torch.randint(0, cfg["vocab_size"], (1, max([args.prefill, *args.contexts]) + args.steps),
                        generator=torch.Generator().manual_seed(0))
    out: dict = {"case": name, "threads": torch.get_num_threads(), "clock": CLOCK.__name__}
    with torch.no_grad():
        x = ids[:, : args.prefill]
        t_zoo, t_hf = [], []
        for _ in range(args.repeat):  # interleaved
            t_zoo.append(best(lambda: model(x), 1))
            t_hf.append(best(lambda: hf(x, use_cache=False), 1))
        out["prefill"] = {"tokens": args.prefill, "zoo_s": min(t_zoo), "hf_s": min(t_hf),
                          "speedup": min(t_hf) / min(t_zoo)}
        out["decode"] = []
        for L in args.contexts:
            def zoo_steps():
                state = model.new_state(1, None)
                model(ids[:, :L], state=state)
                t = CLOCK()
                for i in range(L, L + args.steps):
                    model(ids[:, i: i + 1], state=state)
                return CLOCK() - t

            def hf_steps():
                cache = hf(ids[:, :L], use_cache=True).past_key_values
                t = CLOCK()
                for i in range(L, L + args.steps):
                    cache = hf(ids[:, i: i + 1], past_key_values=cache, use_cache=True).past_key_values
                return CLOCK() - t

            z = min(zoo_steps() for _ in range(args.repeat))
            h = min(hf_steps() for _ in range(args.repeat))
            out["decode"].append({"context": L, "zoo_tok_s": args.steps / z, "hf_tok_s": args.steps / h,
                                  "speedup": h / z})
    return out


def report(r: dict) -> None:
    p = r["prefill"]
    print(f"{r['case']}  ({r['threads']} thread(s), float32, {r['clock']})")
    print(f"  prefill {p['tokens']} tokens: zoo {p['zoo_s']:.3f} s, transformers {p['hf_s']:.3f} s, "
          f"zoo {p['speedup']:.2f}x faster")
    print("  decode  context   zoo tok/s   transformers tok/s   zoo speedup")
    for d in r["decode"]:
        print(f"          {d['context']:7d}   {d['zoo_tok_s']:9.1f}   {d['hf_tok_s']:18.1f}   {d['speedup']:.2f}x")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--case", choices=sorted(CASES), action="append")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--prefill", type=int, default=4096)
    ap.add_argument("--contexts", type=int, nargs="+", default=[512, 1024, 2048, 4096])
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--clock", choices=["cpu", "wall"], default="cpu")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    global CLOCK
    CLOCK = time.process_time if args.clock == "cpu" else time.perf_counter
    torch.set_num_threads(args.threads)
    results = [run_case(CASES[c], args) for c in (args.case or sorted(CASES))]
    for r in results:
        report(r)
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()

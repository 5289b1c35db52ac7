"""zoo's mixture of experts against transformers', side by side in one process on the same
Qwen3-MoE-shaped checkpoint (random weights, written by transformers and loaded by zoo), float32,
the same threads. Prints tokens/s of the forward pass and of a training step (forward, backward,
AdamW step) and the ratio zoo / transformers, for transformers' default experts path (grouped_mm
where torch has it) and its per-expert loop ("eager"). Runs are interleaved; medians are reported.

    python benchmarks/moe.py                  # 4 layers, 32 experts, top-4, 2 x 256 tokens: a few minutes
    python benchmarks/moe.py --layers 8 --experts 64 --top-k 8 --tokens 512   # the shape the issue names
    python benchmarks/moe.py --json out.json

The default size is kept modest so that it finishes in a few minutes on a loaded 2-core machine.
"""

from __future__ import annotations

import argparse
import json
import tempfile

import torch

from timing import interleaved, rate, timed


def make(args, directory):
    import transformers

    cfg = transformers.AutoConfig.for_model(
        "qwen3_moe", vocab_size=args.vocab, hidden_size=args.d_model, intermediate_size=4 * args.d_model,
        moe_intermediate_size=args.d_ff, num_hidden_layers=args.layers, num_attention_heads=4, num_key_value_heads=2,
        head_dim=args.d_model // 4, num_experts=args.experts, num_experts_per_tok=args.top_k, norm_topk_prob=True,
        max_position_embeddings=4096, output_router_logits=False,
    )
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():
        for p in hf.parameters():
            p.normal_(0.0, 0.05) if p.ndim > 1 else p.fill_(1.0)
    hf.save_pretrained(directory)
    return hf


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--d-model", type=int, default=256)
    ap.add_argument("--d-ff", type=int, default=128, help="each expert's width")
    ap.add_argument("--experts", type=int, default=32)
    ap.add_argument("--top-k", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--tokens", type=int, default=256, help="tokens per row (batch 2)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeat", type=int, default=7)
    ap.add_argument("--dispatch", default="auto", choices=("auto", "grouped", "loop"), help="zoo's expert dispatch")
    ap.add_argument("--json")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    import zoo

    with tempfile.TemporaryDirectory() as d:
        hf = make(args, d)
        ours = zoo.from_pretrained(d, progress=False)
    if args.dispatch != "auto":
        state = ours.state_dict()
        ours = zoo.build_model(ours.spec.with_overrides({"layers.*.ffn.dispatch": args.dispatch}))
        ours.load_state_dict(state)
    ids = torch.randint(0, args.vocab, (2, args.tokens), generator=torch.Generator().manual_seed(0))
    n = ids.numel()
    with torch.no_grad():  # same function before timing anything
        diff = (ours(ids) - hf(ids).logits).abs().max().item()

    def forward(model, zoo_model):
        model.eval()

        def run():
            with torch.no_grad():
                model(ids) if zoo_model else model(ids).logits

        return run

    def train_step(model, zoo_model):
        opt = torch.optim.AdamW(model.parameters(), lr=1e-5)

        def run():
            model.train()
            loss = model.loss(ids).loss if zoo_model else model(ids, labels=ids).loss
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

        return run

    results = {"config": vars(args), "max_abs_logit_difference": diff, "tokens": n}
    for impl in ("grouped_mm", "eager"):
        hf.set_experts_implementation(impl)
        for what, make_fn in (("forward", forward), ("train_step", train_step)):
            a, b = make_fn(ours, True), make_fn(hf, False)
            a(), b()  # warm up
            times = interleaved({"zoo": lambda: timed(a)[0], "transformers": lambda: timed(b)[0]}, args.repeat)
            z, h = rate(n, times["zoo"]), rate(n, times["transformers"])
            results[f"{what}/{impl}"] = {"zoo_tokens_per_s": z, "transformers_tokens_per_s": h, "ratio": z / h}
            print(f"{what:10s} vs transformers {impl:10s}: zoo {z:9.0f} tok/s   transformers {h:9.0f} tok/s   "
                  f"ratio {z / h:.2f}x", flush=True)
    print(f"max |logit difference| before timing: {diff:.2e}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()

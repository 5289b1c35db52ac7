"""Absorbed against plain MLA decoding, side by side in one process on the same weights: a
DeepSeek-V3-shaped attention (128-wide nope and value heads, a 64-wide rotary part, a 512-wide kv
latent, a 1536-wide q latent) in a few dense layers, written by transformers as a deepseek_v3
checkpoint and loaded by zoo. A prompt of ``--context`` tokens is prefilled, then ``--new`` tokens are
decoded one at a time; the decode steps are timed for

- zoo, absorbed (the default): W_UK folded into the query, W_UV into the output; the new query
  attends over the cached latents directly;
- zoo, plain: every step up-projects every cached latent into per-head keys and values;
- transformers (its DynamicCache holds the same latents; it up-projects them every step, as plain).

Runs are interleaved; medians are reported, with the ratios absorbed / plain and absorbed / transformers.

    python benchmarks/mla.py                       # 2 layers, 16 heads, context 1024: a few minutes
    python benchmarks/mla.py --heads 128 --context 4096 --json out.json
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
        "deepseek_v3", vocab_size=args.vocab, hidden_size=args.d_model, intermediate_size=2 * args.d_model,
        num_hidden_layers=args.layers, first_k_dense_replace=args.layers, num_attention_heads=args.heads,
        num_key_value_heads=args.heads, q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128,
        qk_rope_head_dim=64, v_head_dim=128, n_routed_experts=8, n_group=1, topk_group=1, num_experts_per_tok=2,
        max_position_embeddings=args.context + args.new + 8, num_nextn_predict_layers=0,  # dense layers: no MTP
    )
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32, attn_implementation="sdpa")
    with torch.no_grad():
        for p in hf.parameters():
            p.normal_(0.0, 0.02) if p.ndim > 1 else p.fill_(1.0)
    hf.eval().save_pretrained(directory)
    return hf


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--d-model", type=int, default=1024)
    ap.add_argument("--vocab", type=int, default=1024)
    ap.add_argument("--context", type=int, default=1024, help="prompt tokens prefilled before decoding")
    ap.add_argument("--new", type=int, default=16, help="tokens decoded one at a time (timed)")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--json")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    import transformers

    import zoo

    with tempfile.TemporaryDirectory() as d:
        hf = make(args, d)
        absorbed = zoo.from_pretrained(d, progress=False).eval()
    plain = zoo.build_model(absorbed.spec.with_overrides({"layers.*.mixer.decode": "plain"})).eval()
    plain.load_state_dict(absorbed.state_dict())
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, args.vocab, (args.batch, args.context), generator=g)
    steps = torch.randint(0, args.vocab, (args.batch, args.new), generator=g)

    def zoo_decode(model):
        def run():
            state = model.new_state(args.batch, args.context + args.new)
            model(prompt, state=state)
            return timed(lambda: torch.cat([model(steps[:, i : i + 1], state=state) for i in range(args.new)], 1))

        return run

    def hf_decode():
        cache = transformers.DynamicCache(config=hf.config)
        hf(prompt, past_key_values=cache, use_cache=True)
        return timed(lambda: torch.cat([hf(steps[:, i : i + 1], past_key_values=cache, use_cache=True).logits
                                        for i in range(args.new)], 1))

    runs = {"absorbed": zoo_decode(absorbed), "plain": zoo_decode(plain), "transformers": hf_decode}
    with torch.no_grad():
        outs = {k: fn()[1] for k, fn in runs.items()}  # also the warm-up
        diff = {k: (outs[k] - outs["transformers"]).abs().max().item() for k in ("absorbed", "plain")}
        times = interleaved({k: (lambda fn=fn: fn()[0]) for k, fn in runs.items()}, args.repeat)
    n = args.batch * args.new
    speed = {k: rate(n, v) for k, v in times.items()}
    for k, s in speed.items():
        print(f"{k:13s} {s:9.1f} decode tok/s")
    print(f"absorbed / plain        {speed['absorbed'] / speed['plain']:.2f}x")
    print(f"absorbed / transformers {speed['absorbed'] / speed['transformers']:.2f}x")
    print(f"max |logit difference| vs transformers: absorbed {diff['absorbed']:.1e}, plain {diff['plain']:.1e}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"config": vars(args), "decode_tokens_per_s": speed, "max_abs_logit_difference": diff,
                       "absorbed_over_plain": speed["absorbed"] / speed["plain"],
                       "absorbed_over_transformers": speed["absorbed"] / speed["transformers"]}, f, indent=2)


if __name__ == "__main__":
    main()

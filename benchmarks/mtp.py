"""Self-speculative decoding with a multi-token prediction module: train a small byte-level model with
one MTP depth on the built-in corpus (Python standard-library sources) with ``zoo.train``, then
decode held-out prompts greedily, plainly and with ``speculative="mtp"``, interleaved in one process
on the same weights and threads. Prints the acceptance rate of the drafts, the tokens per main-model
forward, tokens/s of each and the ratio speculative / plain (medians), and checks that both produced
the same tokens.

    nice -n 10 python benchmarks/mtp.py                 # ~10 minutes on the loaded 2-core machine
    python benchmarks/mtp.py --steps 200 --new 64       # a quick look (acceptance is then lower)
    python benchmarks/mtp.py --json out.json
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time

import torch

from timing import rate, timed


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--d-model", type=int, default=128)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--mtp-weight", type=float, default=0.3)
    ap.add_argument("--prompts", type=int, default=5)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--new", type=int, default=128, help="tokens generated per prompt")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    import zoo
    from zoo.training.data import load_tokens
    from zoo.core.context import ForwardContext
    from zoo.inference.speculative import SpeculationStats
    from zoo.core.state import step_layout

    overrides = {"n_layers": args.layers, "d_model": args.d_model, "vocab_size": 256, "max_seq_len": 1024,
                 "layers.*.mixer.n_heads": 4, "layers.*.mixer.n_kv_heads": 2,
                 "layers.*.ffn.d_ff": 4 * args.d_model, "mtp": {"depth": 1, "weight": args.mtp_weight}}
    held: dict = {}
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as out:
        result = zoo.train("llama3-8b", overrides=overrides, steps=args.steps, seq_len=args.seq_len,
                           global_batch=args.batch, micro_batch=args.batch, lr=args.lr, warmup_steps=50, cpu=True,
                           progress=False, plot=False, export=False, out_dir=out, log_every=50,
                           on_step=lambda metrics, net: held.update(model=net))
    train_s = time.perf_counter() - t0
    model = held["model"].eval()
    last = result.terms[-1]
    print(f"trained {args.steps} steps in {train_s:.0f} s: ce {last['ce']:.3f}, mtp_1 {last['mtp_1']:.3f} (nats/byte)")

    # Prompts from the end of the corpus (the training batches are drawn from all of it, so they
    # are not unseen text; what matters here is that plain and speculative decode the same ones).
    tokens = load_tokens()
    gen = torch.Generator().manual_seed(1)
    starts = torch.randint(len(tokens) // 2, len(tokens) - args.prompt_len, (args.prompts,), generator=gen)
    prompts = [tokens[s: s + args.prompt_len][None].long() for s in starts.tolist()]

    # Teacher-forced agreement on corpus text: at each position, does the MTP draft (given the true next
    # byte) equal the main model's greedy choice one position later? That is the acceptance decoding
    # would see if the model's own continuation were this text; greedy decoding of a small model
    # repeats itself, which makes drafting easier than on real text.
    agree, n = 0, 0
    with torch.no_grad():
        for s in starts.tolist():
            ids = tokens[s: s + 256][None].long()
            h = model.hidden_states(ids)
            greedy = model.logits_from_hidden(h).argmax(-1)
            slots, _, pos = step_layout(1, ids.shape[1] - 1, ids.device)
            out = model.mtp.run(model, 0, h[:, :-1], ids[:, 1:], ForwardContext(position_ids=pos, slots=slots))
            draft = model.mtp.logits(model, 0, out).argmax(-1)  # at i: the byte at i + 2
            agree += int((draft[:, :-1] == greedy[:, 1:-1]).sum())
            n += draft.shape[1] - 1
    forced = agree / n

    for p in prompts[:1]:  # warm up both paths
        model.generate(p, 8)
        model.generate(p, 8, speculative="mtp")
    plain_t, spec_t, stats, same = [], [], SpeculationStats(), True
    for p in prompts:
        seconds, a = timed(lambda: model.generate(p, args.new))
        plain_t.append(seconds)
        s = SpeculationStats()
        seconds, b = timed(lambda: model.generate(p, args.new, speculative="mtp", stats=s))
        spec_t.append(seconds)
        same &= bool(torch.equal(a, b))
        sample = bytes(a[0, -64:].tolist())
        stats.drafted += s.drafted
        stats.accepted += s.accepted
        stats.steps += s.steps
    plain, spec = rate(args.new, plain_t), rate(args.new, spec_t)
    res = {
        "layers": args.layers, "d_model": args.d_model, "steps": args.steps, "train_s": round(train_s),
        "ce": last["ce"], "mtp_1": last["mtp_1"], "acceptance": stats.acceptance, "teacher_forced_agreement": forced,
        "tokens_per_main_forward": args.prompts * args.new / (stats.steps + args.prompts),
        "plain_tokens_per_s": plain, "speculative_tokens_per_s": spec, "ratio": spec / plain,
        "same_tokens": same, "threads": args.threads, "sample": sample.decode("utf-8", "replace"),
    }
    print(f"acceptance of the drafted second token  {stats.acceptance:.1%}  ({stats.accepted}/{stats.drafted})")
    print(f"  on corpus text (teacher-forced)       {forced:.1%}")
    print(f"tokens per main-model forward           {res['tokens_per_main_forward']:.2f}")
    print(f"plain greedy                            {plain:.1f} tokens/s")
    print(f"speculative (mtp)                       {spec:.1f} tokens/s")
    print(f"ratio speculative / plain               {spec / plain:.2f}")
    print(f"same tokens                             {same}")
    print(f"the last 64 bytes of the last output    {sample!r}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=2)


if __name__ == "__main__":
    main()

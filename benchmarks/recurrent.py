"""Recurrent mixers, zoo against transformers' pure-torch path, side by side in one process on the same
random-weight checkpoint (written by transformers, loaded by zoo), float32, the same threads. Runs are
interleaved; medians are reported.

- prefill: tokens/s of one forward over ``--prefill`` tokens (target: zoo >= 1.5x transformers);
- decode: tokens/s of ``--decode`` single-token steps after a prefill of each ``--contexts`` length
  (target: flat in the context, as the state is of fixed size).

    python benchmarks/recurrent.py                       # every case (Mamba-2- and Qwen3-Next-shaped)
    python benchmarks/recurrent.py --case mamba2 --prefill 4096 --contexts 1024 4096 16384
    python benchmarks/recurrent.py --json out.json
    python benchmarks/recurrent.py --case qwen3_next --clock cpu --profile   # prefill time per part

Each case is its own function in CASES (building the pair of models); the timing is shared.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile

import torch

import timing
from timing import rate, timed


def mamba2(args, directory):
    """A small Mamba-2 (4 layers, d_model 512, 16 heads x 64, state 64, 1 group, chunks of 256): the
    layout of state-spaces/mamba2-* at a CPU-friendly width."""
    import transformers

    cfg = transformers.Mamba2Config(vocab_size=args.vocab, hidden_size=512, num_hidden_layers=args.layers,
                                    num_heads=16, head_dim=64, expand=2, state_size=64, n_groups=1, chunk_size=256,
                                    tie_word_embeddings=True)
    torch.manual_seed(0)
    hf = transformers.Mamba2ForCausalLM(cfg).eval()
    hf.save_pretrained(directory)
    return hf


def _qwen3_next(args, directory, **widths):
    import transformers

    cfg = transformers.AutoConfig.for_model(
        "qwen3_next", vocab_size=args.vocab, hidden_size=256, num_hidden_layers=2 * args.layers,
        partial_rotary_factor=0.25, linear_conv_kernel_dim=4, num_experts=8, num_experts_per_tok=2,
        moe_intermediate_size=128, shared_expert_intermediate_size=128, intermediate_size=512,
        max_position_embeddings=32768, tie_word_embeddings=False, **widths)
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    hf.save_pretrained(directory)
    return hf


def qwen3_next(args, directory):
    """A small Qwen3-Next with the released per-head widths of Qwen3-Next-80B-A3B and fewer heads:
    Gated DeltaNet of 4 value heads over 2 key heads, each 128 wide (released: 32 over 16); gated
    attention of 2 query heads over 1 KV head, 256 wide, a quarter rotary (released: 16 over 2);
    d_model 256, 3 Gated DeltaNet : 1 gated attention, MoE of 8 experts top-2 with a gated shared
    expert in every layer."""
    return _qwen3_next(args, directory, num_attention_heads=2, num_key_value_heads=1, head_dim=256,
                       linear_num_value_heads=4, linear_num_key_heads=2, linear_key_head_dim=128,
                       linear_value_head_dim=128)


def qwen3_next_narrow(args, directory):
    """The same model with its heads shrunk to 32 (DeltaNet: 8 value heads over 4 key heads) and 64
    (attention: 4 over 2): the per-head recurrence is then a small share of the work."""
    return _qwen3_next(args, directory, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                       linear_num_value_heads=8, linear_num_key_heads=4, linear_key_head_dim=32,
                       linear_value_head_dim=32)


CASES = {"mamba2": mamba2, "qwen3_next": qwen3_next, "qwen3_next_narrow": qwen3_next_narrow}


def hf_step(hf):
    """transformers' forward with its cache: (ids, cache) -> (logits, cache)."""

    import inspect

    key = "cache_params" if "cache_params" in inspect.signature(hf.forward).parameters else "past_key_values"

    def run(ids, cache):
        out = hf(ids, use_cache=True, **{key: cache})
        cache = getattr(out, "cache_params", None) or getattr(out, "past_key_values", None)
        return out.logits, cache

    return run


def zoo_step(model):
    def run(ids, state):
        state = model.new_state(ids.shape[0]) if state is None else state
        return model(ids, state=state), state

    return run


def measure(args, hf, ours) -> dict:
    V = args.vocab
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, V, (1, max([args.prefill, *args.contexts]) + args.decode), generator=gen)
    runs = {"zoo": zoo_step(ours), "transformers": hf_step(hf)}
    with torch.no_grad():
        a, b = (runs[k](ids[:, :512], None)[0] for k in ("zoo", "transformers"))
        diff = (a - b).abs().max().item()
    result = {"max_logit_diff_512": diff, "max_logit_512": b.abs().max().item(), "prefill": {}, "decode": {}}

    prefill = {k: [] for k in runs}
    with torch.no_grad():
        for _ in range(args.repeat):
            for name, run in runs.items():
                prefill[name].append(timed(lambda: run(ids[:, : args.prefill], None))[0])
    for name, times in prefill.items():
        result["prefill"][name] = rate(args.prefill, times)

    # Decode: a state per (model, context) prefilled once, then the contexts and models interleaved, each
    # run continuing its own state (so a slow spell of the machine hits every context alike).
    live, rates, tokens = {}, {}, {}
    with torch.no_grad():
        for ctx in args.contexts:
            for name, run in runs.items():
                logits, state = run(ids[:, :ctx], None)
                live[name, ctx] = [logits[:, -1:].argmax(-1), state]
        for rep in range(args.repeat):
            for ctx in args.contexts:
                for name, run in runs.items():
                    slot, out = live[name, ctx], []

                    def decode():
                        for _ in range(args.decode):
                            logits, slot[1] = run(slot[0], slot[1])
                            slot[0] = logits[:, -1:].argmax(-1)
                            out.append(slot[0])

                    rates.setdefault((name, ctx), []).append(args.decode / timed(decode)[0])
                    if rep == 0:
                        tokens[name, ctx] = torch.cat(out, 1)
    for ctx in args.contexts:
        result["decode"][ctx] = {name: statistics.median(rates[name, ctx]) for name in runs}
        result["decode"][ctx]["same_tokens"] = bool(torch.equal(tokens["zoo", ctx], tokens["transformers", ctx]))
    return result


def profile(args, hf, ours) -> None:
    """Each part's share of one prefill of ``--prefill`` tokens, both models: the time inside each
    submodule (by parent class, attribute and class, summed over the layers) and inside the recurrent
    cores and the DeltaNet's convolution, which are functions; minimum over ``--repeat`` runs. Forward
    hooks time each module call, so nested rows overlap (a layer's row includes its parts')."""
    import collections
    import importlib

    spent = collections.defaultdict(float)

    def add(key, seconds):
        spent[key] += seconds

    def hooks(model, tag):
        for parent in model.modules():
            for attr, child in parent.named_children():
                key = (tag, f"{type(parent).__name__}.{attr}: {type(child).__name__}" if not attr.isdigit()
                       else type(child).__name__)
                child.register_forward_pre_hook(lambda m, a: setattr(m, "_t0", timing.clock()))
                child.register_forward_hook(lambda m, a, o, key=key: add(key, timing.clock() - m._t0))

    def wrap(module, name, key):
        module = importlib.import_module(module)
        fn = getattr(module, name)

        def timed_fn(*a, **k):
            t = timing.clock()
            out = fn(*a, **k)
            add(key, timing.clock() - t)
            return out

        setattr(module, name, timed_fn)

    # the cores and transformers' convolution are module functions, looked up when called
    wrap("zoo.components.mixers.gated_deltanet", "chunk_gated_delta_rule", ("zoo", "(function) chunk_gated_delta_rule"))
    wrap("zoo.components.mixers._recurrent", "chunked", ("zoo", "(function) recurrent.chunked"))
    hf_module = importlib.import_module(type(hf).__module__)
    for name in ("torch_chunk_gated_delta_rule", "causal_conv1d_fn"):
        if hasattr(hf_module, name):
            wrap(type(hf).__module__, name, ("transformers", f"(function) {name}"))
    hooks(ours, "zoo")
    hooks(hf, "transformers")
    ids = torch.randint(0, args.vocab, (1, args.prefill), generator=torch.Generator().manual_seed(0))
    best = {}
    with torch.no_grad():
        for _ in range(args.repeat):
            for tag, run in (("zoo", lambda: ours(ids)), ("transformers", lambda: hf(ids, use_cache=False))):
                spent.clear()
                t = timing.clock()
                run()
                spent[tag, "(whole forward)"] = timing.clock() - t
                for key, value in spent.items():
                    best[key] = min(best.get(key, float("inf")), value)
    for tag in ("zoo", "transformers"):
        print(f"{tag}: seconds in each part, prefill of {args.prefill} tokens (min of {args.repeat})")
        for (t, key), value in sorted(best.items(), key=lambda kv: -kv[1]):
            if t == tag and value >= 0.002:
                print(f"  {value:7.3f}  {key}")


def report(case, r) -> None:
    z, t = r["prefill"]["zoo"], r["prefill"]["transformers"]
    print(f"[{case}] logits at 512 tokens: max |diff| {r['max_logit_diff_512']:.2e} (largest |logit| "
          f"{r['max_logit_512']:.1f})")
    print(f"[{case}] prefill tok/s  zoo {z:8.1f}  transformers {t:8.1f}  ratio {z / t:5.2f}x")
    for ctx, d in r["decode"].items():
        z, t = d["zoo"], d["transformers"]
        print(f"[{case}] decode after {ctx:6d}: tok/s zoo {z:7.1f}  transformers {t:7.1f}  ratio {z / t:5.2f}x"
              f"  greedy tokens equal: {d['same_tokens']}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--case", choices=sorted(CASES), nargs="*", default=sorted(CASES))
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--prefill", type=int, default=4096)
    ap.add_argument("--contexts", type=int, nargs="*", default=[1024, 4096, 16384])
    ap.add_argument("--decode", type=int, default=32, help="tokens decoded after each context")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--clock", choices=sorted(timing.CLOCKS), default="wall",
                    help="cpu: the process's CPU time, which other jobs on a shared machine disturb far less")
    ap.add_argument("--json")
    ap.add_argument("--profile", action="store_true", help="time each part of one prefill instead")
    ap.add_argument("--flush-denormal", action="store_true",
                    help="set the CPU to flush subnormal floats to zero for both implementations "
                         "(torch.set_flush_denormal): isolates the gain that is not avoiding subnormal arithmetic")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if args.flush_denormal and not torch.set_flush_denormal(True):
        raise SystemExit("--flush-denormal: this CPU cannot flush subnormals")
    timing.use_clock(args.clock)

    import zoo

    results = {}
    for case in args.case:
        with tempfile.TemporaryDirectory() as d:
            hf = CASES[case](args, d)
            ours = zoo.from_pretrained(d, progress=False)
        if args.profile:
            print(f"[{case}]")
            profile(args, hf, ours)
            continue
        results[case] = measure(args, hf, ours)
        report(case, results[case])
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "results": results}, f, indent=2)


if __name__ == "__main__":
    main()

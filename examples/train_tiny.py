"""Train a tiny Llama-3-shaped model on the built-in corpus (Python's own sources, as bytes).

    python examples/train_tiny.py                      # one process, a few minutes on a laptop CPU
    torchrun --nproc_per_node 2 examples/train_tiny.py # DDP over two processes (same global batch)
    torchrun --nproc_per_node 2 examples/train_tiny.py --fsdp

Any preset trains the same way: shrink it with overrides, or give a recipe file.
"""

import argparse

import zoo
from zoo.training.data import load_tokens, unigram_entropy

TINY = {
    "n_layers": 2, "d_model": 64, "vocab_size": 256, "max_seq_len": 128,
    "layers.*.mixer.n_heads": 4, "layers.*.mixer.n_kv_heads": 2, "layers.*.ffn.d_ff": 128,
}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="llama3-8b")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--fsdp", action="store_true")
    ap.add_argument("--out-dir", default="runs/tiny")
    args = ap.parse_args()

    result = zoo.train(
        args.model, overrides=TINY, steps=args.steps, seq_len=64, global_batch=16, micro_batch=8, lr=3e-3,
        warmup_steps=20, save_every=100, fsdp=args.fsdp or None, out_dir=args.out_dir,
    )
    if result.main_process and result.losses:
        h = unigram_entropy(load_tokens())
        print(f"unigram entropy of the corpus: {h:.3f} nats/byte")
        print(f"final cross-entropy: {sum(result.ce[-20:]) / len(result.ce[-20:]):.3f} nats/byte "
              f"after {result.step} steps, {result.tokens_per_s:,.0f} tokens/s")
        print(f"mean log(Z)^2: {result.z[-1]:.3g}; checkpoint {result.checkpoint}; plot {result.plot}; "
              f"export {result.export}")


if __name__ == "__main__":
    main()

"""Post-hoc DeepSeek Sparse Attention: give a dense MLA model a lightning indexer and make it sparse.

    python examples/dsa_adaptation.py            # a few minutes on a laptop CPU
    python examples/dsa_adaptation.py --tiny     # the smoke test's miniature (seconds)

The recipe of DeepSeek-V3.2, at toy scale (docs/mechanisms/deepseek-sparse-attention.md has the numbers):

1. train a small dense model (mixer ``mla``);
2. add an indexer (mixer ``dsa``, same weights; ``index_topk`` at least the sequence length, so
   attention stays dense) and train the indexer alone, main model frozen, on its KL loss against
   the dense attention distribution (the ``dsa_indexer_kl`` auxiliary loss);
3. lower ``index_topk`` so each query attends to a few keys, and train everything: the language
   model on its loss, the indexer on its KL over the keys it selected.

The task needs attention to one far token: each sequence is a random block of ``period`` tokens
repeated, so a token is predicted by the one ``period - 1`` places back. Loss is measured on the
repeats only (the first block is unpredictable). With 4 keys of up to 63, an untrained indexer
almost never selects the one that matters.
"""

from __future__ import annotations

import argparse

import torch

import zoo

MLA = {"name": "mla", "n_heads": 4, "q_lora_rank": 32, "kv_lora_rank": 32, "qk_nope_head_dim": 16,
       "qk_rope_head_dim": 8, "v_head_dim": 16}
INDEXER = {"index_n_heads": 4, "index_head_dim": 16}


def spec(mixer, *, vocab, d_model, n_layers, seq_len):
    layer = {"mixer": mixer, "ffn": {"name": "swiglu", "d_ff": 2 * d_model}, "norm": "rmsnorm"}
    return zoo.ModelSpec.from_dict({"vocab_size": vocab, "d_model": d_model, "n_layers": n_layers,
                                    "max_seq_len": seq_len, "layers": {"default": layer},
                                    "position": {"name": "rope", "layout": "pairs_to_half"}})


def batch(gen, n, seq_len, period, vocab):
    block = torch.randint(0, vocab, (n, period), generator=gen)
    ids = block.repeat(1, seq_len // period + 1)[:, :seq_len]
    labels = ids.clone()
    labels[:, :period] = -100  # the first block cannot be predicted
    return ids, labels


def train(model, params, steps, data, lr):
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    model.train()
    for _ in range(steps):
        ids, labels = data()
        loss = model.loss(ids, labels).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    model.eval()


@torch.no_grad()
def evaluate(model, eval_set):
    """Mean cross-entropy on the repeats, and (for DSA) the indexer's KL to the attention it serves."""
    model.train()  # the indexer's KL is computed in training mode only; nothing here steps
    ce, kl = [], []
    for ids, labels in eval_set:
        out = model.loss(ids, labels)
        kl.append(float(out.aux.get("dsa_indexer_kl", torch.tensor(float("nan")))) / len(model.layers))
        ce.append(float(out.ce))
    model.eval()
    return sum(ce) / len(ce), sum(kl) / len(kl)


def sparse_copy(model, mixer, sizes):
    """A DSA model of ``mixer`` with ``model``'s weights (its indexer kept if it has one)."""
    new = zoo.build_model(spec(mixer, **sizes), seed=1)
    missing, unexpected = new.load_state_dict(model.state_dict(), strict=False)
    assert not unexpected and all(".indexer." in k for k in missing), (missing, unexpected)
    return new


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--tiny", action="store_true", help="the smoke test's miniature")
    ap.add_argument("--topk", type=int, default=4)
    args = ap.parse_args(argv)
    torch.manual_seed(0)
    if args.tiny:
        sizes, period, steps, n_eval = dict(vocab=32, d_model=32, n_layers=1, seq_len=24), 8, (4, 3, 3), 1
    else:
        sizes, period, steps, n_eval = dict(vocab=64, d_model=64, n_layers=1, seq_len=64), 16, (300, 100, 150), 4
    gen = torch.Generator().manual_seed(0)
    data = lambda: batch(gen, 16, sizes["seq_len"], period, sizes["vocab"])  # noqa: E731
    eval_gen = torch.Generator().manual_seed(123)
    eval_set = [batch(eval_gen, 32, sizes["seq_len"], period, sizes["vocab"]) for _ in range(n_eval)]
    dense_topk = {**MLA, "name": "dsa", **INDEXER, "index_topk": sizes["seq_len"]}
    sparse = {**dense_topk, "index_topk": args.topk}
    rows = []

    dense = zoo.build_model(spec(MLA, **sizes), seed=0)
    train(dense, dense.parameters(), steps[0], data, 3e-3)
    rows.append(("1. dense MLA, trained", evaluate(dense, eval_set)[0], None))
    print(*rows[-1][:2], flush=True)

    untrained = sparse_copy(dense, sparse, sizes)
    rows.append((f"   + untrained indexer, top-{args.topk}", *evaluate(untrained, eval_set)))

    warm = sparse_copy(dense, dense_topk, sizes)  # attention stays dense: the indexer learns the dense distribution
    for name, p in warm.named_parameters():
        p.requires_grad_(".indexer." in name)
    train(warm, [p for p in warm.parameters() if p.requires_grad], steps[1], data, 3e-3)
    for p in warm.parameters():
        p.requires_grad_(True)
    rows.append(("2. indexer trained alone (KL, model frozen)", *evaluate(warm, eval_set)))
    print(*rows[-1], flush=True)
    warmed = sparse_copy(warm, sparse, sizes)
    rows.append((f"   then top-{args.topk}, no further training", *evaluate(warmed, eval_set)))

    train(warmed, warmed.parameters(), steps[2], data, 1e-3)
    rows.append((f"3. sparse top-{args.topk}, trained", *evaluate(warmed, eval_set)))

    print(f"copy loss (nats/token) on {sizes['seq_len']}-token sequences, period {period}; "
          f"indexer KL to the attention it serves, per layer")
    for name, ce, kl in rows:
        print(f"  {name:<46} loss {ce:.3f}" + (f"   KL {kl:.3f}" if kl is not None else ""))
    return rows


if __name__ == "__main__":
    main()

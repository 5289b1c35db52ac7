"""Helpers the parity tests of several formats share: tiny transformers checkpoints made once per
case and loaded by zoo, and the logits check with a left-padded row."""

import torch

import zoo
from zoo.checkpoints.tiny import make_tiny


def tiny_pairs(tmp_path_factory, cases: dict, *, std: float):
    """``get(case) -> (transformers model, zoo model)`` for ``cases`` (name -> (model_type, overrides of
    the format's tiny config)), each made, saved by transformers and loaded by zoo the first time it is asked
    for. Every parameter and every buffer the format randomises is moved by N(0, ``std``)."""
    made = {}

    def get(case):
        if case not in made:
            d = tmp_path_factory.mktemp(case)
            model_type, overrides = cases[case]
            made[case] = (make_tiny(model_type, d, std=std, overrides=overrides), zoo.from_pretrained(d))
        return made[case]

    return get


@torch.no_grad()
def assert_logits_equal_with_a_left_padded_row(hf, ours, *, atol: float = 1e-5) -> None:
    """Two rows of 20 tokens, the second left-padded by 6: zoo's logits at the real tokens equal
    transformers' (given the position ids that skip the padding)."""
    ids = torch.randint(0, 128, (2, 20), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[1, :6] = 0
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    ref = hf(ids, attention_mask=mask, position_ids=pos).logits
    got = ours(ids, attention_mask=mask)
    torch.testing.assert_close(got[mask.bool()], ref[mask.bool()], atol=atol, rtol=0)

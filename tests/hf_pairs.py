"""Helpers the parity tests of several formats share: tiny transformers checkpoints made once per
case and loaded by zoo, the logits check with a left-padded row, and several tokens fed onto a
decode state."""

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


@torch.no_grad()
def assert_several_tokens_continue_the_full_forward(hf, ours, *, cache: str, atol: float) -> None:
    """Two rows of 23 tokens: a prefill of 7, then 12 tokens at once onto that state, then the last 4
    at once. transformers' cache (passed and returned as ``cache``: ``past_key_values`` or
    ``cache_params``) and zoo's decode state each give what their full forward gives."""
    ids = torch.randint(0, 128, (2, 23), generator=torch.Generator().manual_seed(3))
    full = hf(ids).logits
    kept = getattr(hf(ids[:, :7], use_cache=True), cache)
    theirs = hf(ids[:, 7:19], use_cache=True, **{cache: kept}).logits
    state = ours.new_state(2, None)
    ours(ids[:, :7], state=state)
    mine = ours(ids[:, 7:19], state=state)
    torch.testing.assert_close(theirs, full[:, 7:19], atol=atol, rtol=0)
    torch.testing.assert_close(mine, full[:, 7:19], atol=atol, rtol=0)
    torch.testing.assert_close(ours(ids[:, 19:], state=state), full[:, 19:], atol=atol, rtol=0)

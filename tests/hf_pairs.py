"""Helpers the parity tests of several formats share: tiny transformers checkpoints made once per
case and loaded by zoo, the logits check with a left-padded row, several tokens fed onto a
decode state, and float32 tolerances stated against a float64 run of the reference."""

import copy
from pathlib import Path
from typing import Any, NamedTuple

import torch

import zoo
from zoo.checkpoints.tiny import make_tiny, tiny_formats


def own(kind: str, *, installed: bool = False) -> set[str]:
    """The names of ``kind`` that zoo itself ships (registered by one of its built-in plugins), and
    with ``installed`` also those of installed distributions' plugins; never a name a test module
    registered in this process. zoo's sweeps take zoo's own entries: an installed plugin's are
    tested by that plugin's own tests, so zoo's suite does not change with what else is installed."""
    manager = zoo.manager()

    def counted(name):
        provider = manager.provider_of(kind, name)
        info = manager.plugins.get(provider)
        if info is None:  # registered outside any plugin: zoo's own only if a built-in provider
            return provider in manager.builtin_plugins
        return info.builtin or (installed and bool(info.distribution))

    return {n for n in zoo.list_components(kind) if counted(n)}


def own_tiny_formats() -> list[str]:
    """The model_types with a tiny config that zoo itself ships (:func:`own`)."""
    ours = own("checkpoint_format")
    return [m for m in tiny_formats() if m in ours]


class HfPair(NamedTuple):
    """A tiny transformers model, zoo's load of the checkpoint transformers saved, and its folder."""

    hf: Any
    zoo: Any
    path: Path


def make_pair(directory: Path, model_type: str, *, std: float = 0.25, **overrides: Any) -> HfPair:
    """The format's tiny config with ``overrides``, made and saved into ``directory`` by transformers
    (every parameter and every buffer the format randomises moved by N(0, ``std``)) and loaded by zoo.
    Tests reach it through the ``hf_pair`` fixture (tests/conftest.py), which makes each once."""
    hf = make_tiny(model_type, directory, std=std, overrides=overrides)
    return HfPair(hf, zoo.from_pretrained(directory), Path(directory))


def float64_twin(hf):
    """A float64 copy of the transformers model ``hf`` (its experts on the per-expert loop: the
    grouped matmul takes no float64). Where transformers itself computes a step in float32 whatever
    the model's dtype (its norms upcast to float32 and back), the twin keeps that rounding, which
    only makes the bound of :func:`assert_within_reference_error` tighter."""
    twin = copy.deepcopy(hf).to(torch.float64).eval()
    twin.set_experts_implementation("eager")
    return twin


def assert_within_reference_error(got, ref, exact, *, factor: float = 2.0, floor: float = 1e-5,
                                  what: str = "logits") -> None:
    """zoo's float32 ``got`` is no further from ``exact`` (the reference run in float64) than
    ``factor`` times the reference's own float32 result ``ref`` is, plus ``floor``. Both float32
    errors come from the same rounding of the same sums, so their ratio does not move with the
    thread count or the machine the way one fixed absolute tolerance at one CPU's floor does; a
    wrong zoo is as far from ``exact`` as it is wrong."""
    exact = exact.double()
    own = (ref.double() - exact).abs().max().item()
    err = (got.double() - exact).abs().max().item()
    assert err <= factor * own + floor, (
        f"{what}: zoo's float32 is {err:.3g} from the reference's float64 run, the reference's own float32 "
        f"{own:.3g} (allowed {factor:g} x that + {floor:g})")


@torch.no_grad()
def assert_same_model(model, loaded, vocab_size: int) -> None:
    """``loaded`` (a checkpoint of ``model`` read back) has ``model``'s tensors, buffers included, bit
    for bit, and computes its logits and greedy tokens."""
    a, b = model.state_dict(), loaded.state_dict()
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k
    ids = torch.randint(0, vocab_size, (2, 9))
    assert torch.equal(model(ids), loaded(ids))
    assert torch.equal(zoo.generate(model, ids, 4), zoo.generate(loaded, ids, 4))


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


@torch.no_grad()
def assert_greedy_tokens_equal(hf, ours, *, prompt: int = 9, new: int = 8, seed: int = 1) -> None:
    """Two rows of ``prompt`` random tokens: zoo's ``new`` greedy tokens are transformers'."""
    ids = torch.randint(0, 128, (2, prompt), generator=torch.Generator().manual_seed(seed))
    want = hf.generate(ids, max_new_tokens=new, do_sample=False, attention_mask=torch.ones_like(ids))
    assert torch.equal(zoo.generate(ours, ids, max_new_tokens=new), want)


def assert_dsa_state_is_the_cache(state, cache, seen: int) -> None:
    """zoo's decode state of a DSA model equals transformers' cache over the first ``seen`` slots:
    per layer the normed latent and the rotated key part, and the indexer keys where the layer has an
    indexer (a layer sharing another's selection holds none, in zoo as in transformers)."""
    for i, (mine, theirs) in enumerate(zip(state.layers, cache.layers)):
        torch.testing.assert_close(mine.kv.k[:, :, :seen], theirs.keys, atol=1e-5, rtol=0, msg=f"layer {i} latent")
        torch.testing.assert_close(mine.kv.v[:, :, :seen], theirs.values, atol=1e-5, rtol=0, msg=f"layer {i} k_rope")
        held = getattr(theirs, "indexer_keys", None)
        if mine.keys is None:
            assert held is None, f"layer {i}: transformers holds indexer keys where zoo's layer shares a selection"
        else:
            torch.testing.assert_close(mine.keys.k[:, :seen], held, atol=1e-5, rtol=0, msg=f"layer {i} indexer keys")

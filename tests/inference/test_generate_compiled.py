"""The opt-in compiled decode path (static cache, one torch.compile'd step) gives exactly the tokens
of the eager path, past a sliding window, with soft-caps and with a left-padded batch, and compiles
its step once for every decode step."""

import pytest
import torch

import zoo

pytestmark = pytest.mark.slow  # compiled decoding

TINY = {
    "n_layers": 2, "d_model": 64, "vocab_size": 128, "layers.*.ffn.d_ff": 96,
    "layers.*.mixer.n_heads": 4, "layers.*.mixer.n_kv_heads": 2, "layers.*.mixer.head_dim": 16,
}
SPECS = {
    "llama2-7b": {},
    "gemma2-2b": {"layers.local.mixer.window": 5},  # soft-caps; a window far shorter than the sequence
}


@pytest.mark.parametrize("name", SPECS)
@torch.no_grad()
def test_compiled_greedy_equals_eager(name, one_thread):
    torch._dynamo.reset()
    model = zoo.build(name, overrides={**TINY, **SPECS[name]}, seed=0).eval()
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 128, (2, 7), generator=gen)
    mask = torch.ones_like(ids)
    mask[1, :3] = 0  # the second prompt is left-padded
    ids[1, :3] = 0
    with torch._dynamo.config.patch(error_on_recompile=True):  # one compilation serves every step
        for kw in ({}, {"attention_mask": mask}):
            eager = zoo.generate(model, ids, 16, **kw)
            compiled = zoo.generate(model, ids, 16, compile=True, **kw)
            assert torch.equal(compiled, eager)


def test_compile_refuses_a_given_state():
    model = zoo.build("llama2-7b", overrides=TINY, seed=0)
    with pytest.raises(ValueError, match="state"):
        zoo.generate(model, torch.zeros(1, 3, dtype=torch.long), 2, compile=True, state=model.new_state(1))

"""Linear attention and lightning attention: both forms of the shared core, decoding onto a fixed-size
state (the conformance suite), bad input named by field."""

import pytest
import torch

import zoo
import zoo.testing as zt
from zoo.core.spec import SpecError

pytestmark = pytest.mark.usefixtures("one_thread")

VARIANTS = [
    ("linear_attention", {"n_heads": 2, "head_dim": 8, "chunk": 4}),
    ("linear_attention", {"n_heads": 2, "head_dim": 8, "feature_map": "elu1", "normalize": "sum", "chunk": 3}),
    ("linear_attention", {"n_heads": 2, "head_dim": 8, "feature_map": "relu", "decay": "retnet", "chunk": 5}),
    ("linear_attention", {"n_heads": 2, "head_dim": 8, "feature_map": "silu", "decay": [0.9, 0.5]}),
    ("lightning_attention", {"n_heads": 2, "head_dim": 8, "chunk": 4}),
]


def model(name, cfg, seed=0):
    m = zt.tiny_model(zt.hybrid_spec(name, cfg), seed=seed)
    with torch.no_grad():  # move the decay buffers off their schedule, so the state's decay shows
        for b_name, b in m.named_buffers():
            if b_name.endswith("slope"):
                b.mul_(1 + torch.rand(b.shape, generator=torch.Generator().manual_seed(3)))
    return m


@pytest.mark.parametrize("name,cfg", VARIANTS, ids=lambda v: str(v))
def test_decoding_matches_the_full_forward(name, cfg):
    m = model(name, cfg)
    ids = torch.randint(0, m.spec.vocab_size, (2, 13), generator=torch.Generator().manual_seed(0))
    zt.check_decoding(m, ids, what=name, atol=1e-5)


@pytest.mark.parametrize("name,cfg", VARIANTS[:1] + VARIANTS[-1:], ids=lambda v: str(v))
def test_the_state_is_fixed_size_and_accounted(name, cfg):
    m = model(name, cfg)
    mixer = m.layers[0].mixer
    sizes = []
    for T in (4, 40):
        state = m.new_state(1, None)
        with torch.no_grad():
            m(torch.zeros(1, T, dtype=torch.long), state=state)
        sizes.append(state.layers[0].nbytes())
    assert sizes[0] == sizes[1] == 2 * 8 * 8 * 4  # H x Dk x Dv fp32, however long the context
    assert mixer.cost(10_000).state_fixed == 2 * 8 * 8 and mixer.cost(10_000).state_per_token == 0


def test_retnet_decay_is_one_gamma_per_head():
    m = model("linear_attention", {"n_heads": 4, "head_dim": 8, "decay": "retnet"})
    got = m.layers[0].mixer.log_gamma.exp()
    torch.testing.assert_close(got, torch.tensor([1 - 2 ** -5, 1 - 2 ** -6, 1 - 2 ** -7, 1 - 2 ** -8]))


@pytest.mark.parametrize("cfg,field", [
    ({"n_heads": 2, "feature_map": "softmax"}, "feature_map"),
    ({"n_heads": 2, "chunk": 0}, "chunk"),
    ({"n_heads": 2, "normalize": "sum"}, "normalize"),
    ({"n_heads": 2, "decay": [0.9]}, "decay"),
    ({"n_heads": 2, "decay": 1.5}, "decay"),
])
def test_bad_config_is_named(cfg, field):
    with pytest.raises(SpecError, match=rf"layers\.part\.mixer\.{field}"):
        zt.hybrid_spec("linear_attention", cfg)


def test_lightning_bad_activation_is_named():
    with pytest.raises(SpecError, match=r"layers\.part\.mixer\.activation"):
        zt.hybrid_spec("lightning_attention", {"n_heads": 2, "activation": "nope"})

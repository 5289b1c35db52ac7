"""What the ablation report shows says what it is: bands over seeds, the claim in the title, legends
that read, and a console line that prints the number the table shows (and says what it is)."""

import pytest

from zoo.tools import ablate

pytest.importorskip("matplotlib")

CLAIM = "QK-norm lets a model train at learning rates that make the plain model diverge"


def history(start, steps=20):
    return [{"step": i + 1, "loss": start - 0.1 * i, "ce": start - 0.1 * i, "z": 1.0, "attn_logit_max": [3.0 + i],
             "log_z_rms": 1.0, "tokens_per_s": 100.0} for i in range(steps)]


def ablation(seeds=(0, 1, 2)):
    return ablate.from_dict({"ablation": {"name": "qk-norm", "claim": CLAIM, "base": "llama3-8b", "lrs": [1e-3, 1e-2],
                                          "seeds": list(seeds)},
                             "set": {"n_layers": 1, "d_model": 32, "vocab_size": 256, "layers.*.mixer.n_heads": 4,
                                     "layers.*.mixer.n_kv_heads": 4, "layers.*.ffn.d_ff": 64},
                             "train": {"steps": 20, "seq_len": 16, "global_batch": 4, "micro_batch": 4, "cpu": True},
                             "variants": {"plain": {}, "qk-norm": {"layers.*.mixer.qk_norm": "head"}}})


def results(ab):
    return [{"variant": v, "lr": lr, "seed": s, "status": "ok", "diverged_step": None, "params": 1, "kv_bytes_per_token": 1,
             "history": history(5.0 + s * 0.1 + lr)} for v in ab.variants for lr in ab.lrs for s in ab.seeds]


def legend_texts(fig):
    return [t.get_text() for ax in fig.axes if ax.get_legend() for t in ax.get_legend().get_texts()]


def legend_title(fig):
    return fig.axes[0].get_legend().get_title().get_text()


def test_lr_figure_names_the_claim_and_says_the_band_is_over_seeds():
    ab = ablation()
    fig = ablate.lr_figure(ablate.summarise(ab, results(ab)))
    assert CLAIM in fig._suptitle.get_text().replace("\n", " ")
    assert legend_title(fig) == "line: mean over 3 seeds; band: min to max"
    assert len(fig.axes[0].collections) == 2  # a band per variant
    legend = fig.axes[0].get_legend()
    assert all(t.get_fontsize() >= 8 for t in [*legend.get_texts(), legend.get_title()])
    assert "mean of the last tenth of the steps" in fig.axes[0].get_title()


def test_one_seed_draws_no_band_and_says_so():
    ab = ablation(seeds=(0,))
    fig = ablate.lr_figure(ablate.summarise(ab, results(ab)))
    assert legend_title(fig) == "one seed (no band)" and not fig.axes[0].collections


def test_curve_figures_name_the_claim_and_read():
    ab = ablation()
    fig = ablate.curves_figure(ab, results(ab), "ce", "cross-entropy")
    assert CLAIM in fig._suptitle.get_text().replace("\n", " ") and "mean over 3 seeds" in fig._suptitle.get_text()
    assert all(t.get_fontsize() >= 8 for t in (t for ax in fig.axes for t in ax.get_legend().get_texts()))


def test_the_console_prints_the_final_loss_the_table_shows(tmp_path, monkeypatch):
    ab = ablation(seeds=(0,))
    made = {(r["variant"], r["lr"], r["seed"]): r for r in results(ab)}
    monkeypatch.setattr(ablate, "train_one", lambda ab_, spec, variant, lr, seed, out, **kw: made[(variant, lr, seed)])
    lines = []
    summary = ablate.sweep(ab, tmp_path, report=False, echo=lines.append)
    for variant, v in summary["variants"].items():
        for p in v["per_lr"]:
            line = next(x for x in lines if f"] {variant} lr={p['lr']:g} " in x)
            assert f"final loss {p['final_loss']:.4f} (cross-entropy, mean of the last tenth of the steps)" in line

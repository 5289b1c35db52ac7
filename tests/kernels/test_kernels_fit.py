"""zoo's recurrent Triton kernels compiled for sm_90 (H100/H200) on the CPU, at the shapes the presets
give them: every launch of the forward and backward, in fp32 and bf16, fits the 232,448 bytes of
shared memory a block may use there. Registers and stack bytes per thread are printed as a table
(``pytest -s``; docs/reference/kernels.md shows it). The compile runs in a subprocess without
``TRITON_INTERPRET`` (under the interpreter nothing is compiled); Triton caches what it compiled,
so a second run takes seconds."""

import json
import os
import subprocess
import sys

import pytest
import torch

pytest.importorskip("triton")

from zoo.tools import kernel_fit as fit  # noqa: E402

needs_ptxas = pytest.mark.skipif(fit.cuobjdump() is None, reason="Triton's ptxas/cuobjdump are missing: nothing can be compiled for sm_90")


def survey(tmp_path, *args):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = tmp_path / "fit.json"
    done = subprocess.run([sys.executable, "-m", "zoo.tools.kernel_fit", "--json", str(out), *args],
                          env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-4000:]
    print(done.stdout)
    rows = json.loads(out.read_text())
    assert rows, "nothing was compiled"
    return rows


def assert_fit(rows):
    misfits = [r for r in rows if not r["fits"]]
    assert not misfits, "\n" + fit.table(misfits)
    assert all(r["shared_limit"] == 232_448 and r["registers"] <= fit.MAX_REGISTERS for r in rows)
    spilling = [r for r in rows if r["stack"] > fit.MAX_STACK[r["inputs"]]]
    assert not spilling, "stack per thread over fit.MAX_STACK:\n" + fit.table(spilling)


def test_the_presets_give_the_recurrent_kernels_their_shapes():
    """Read from the presets built on the meta device (no weights allocated): Qwen3-Next's 16 key
    heads and 32 value heads of 128 in chunks of 64, MiniMax's 64 heads of 128 in chunks of 256,
    Mamba-2's 80 heads with 128-wide keys and 64-wide values."""
    problems = {p.presets[0]: p for p in fit.preset_problems(["qwen3-next-80b-a3b", "minimax-text-01", "mamba2-2.7b"])}
    assert problems["qwen3-next-80b-a3b"].component == "gated_delta"
    assert problems["qwen3-next-80b-a3b"].shapes[:3] == ((1, 16, 8, 128), (1, 16, 8, 128), (1, 32, 8, 128))
    assert problems["qwen3-next-80b-a3b"].kwargs == (("arg6", 64),)
    assert problems["minimax-text-01"].shapes[0] == (1, 64, 8, 128) and problems["minimax-text-01"].kwargs == (("chunk", 256),)
    assert problems["mamba2-2.7b"].shapes[2] == (1, 80, 8, 64)
    assert fit.widened(problems["minimax-text-01"], 256).shapes[2] == (1, 64, 8, 256)


def test_recorded_launches_carry_their_grid_configuration_and_arguments():
    """Launches are recorded, not run: every configuration a call site may choose is recorded."""
    from zoo.components.kernels import recurrent

    problem = fit.widened(fit.preset_problems(["minimax-text-01"])[0], 256)
    launches = fit.launches(problem, torch.bfloat16, T=16)
    names = [x.name for x in launches]
    assert names.count("recurrent._fwd") == len(recurrent._configs(256, 64)) == 2
    fwd = next(x for x in launches if x.name == "recurrent._fwd")
    assert fwd.grid == (64, 4) and fwd.constexprs()["BV"] == 64 and fwd.constexprs()["PREC"] == "tf32"
    assert {(x.num_warps, x.num_stages) for x in launches if x.name == "recurrent._fwd"} == set(recurrent._configs(256, 64))


@needs_ptxas
def test_the_gated_delta_backward_fits_at_qwen3_next_heads_in_fp32(tmp_path):
    """It needed 238,592 bytes with three pipeline stages; two fit."""
    rows = survey(tmp_path, "--presets", "qwen3-next-80b-a3b", "--widths", "", "--dtypes", "fp32",
                  "--kernels", "gated_deltanet._bwd", "--first-config")
    assert [r["constexprs"]["BK"] for r in rows] == [128]
    assert_fit(rows)


@needs_ptxas
def test_the_scalar_decay_forward_fits_at_head_dim_256(tmp_path):
    """With the whole 256 x 256 fp32 state per program it needed 360,576 bytes; blocks of 64 value
    columns fit (bf16 inputs: TF32 products, which ptxas compiles several times faster than IEEE)."""
    rows = survey(tmp_path, "--presets", "minimax-text-01", "--widths", "256", "--widened-only", "--dtypes", "bf16",
                  "--kernels", "recurrent._fwd", "--first-config")
    assert [(r["constexprs"]["BK"], r["constexprs"]["BV"]) for r in rows] == [(256, 64)]
    assert_fit(rows)


@pytest.mark.slow
@needs_ptxas
def test_every_recurrent_kernel_fits_sm90_at_every_preset_shape_and_configuration(tmp_path):
    """Every preset's recurrent mixers, and each at head dims 64 and 256, in fp32 and bf16, every
    launch configuration the call sites may choose (the autotuner's candidates on a GPU)."""
    rows = survey(tmp_path)
    assert {r["kernel"] for r in rows} == {"recurrent._fwd", "recurrent._bwd_dq", "recurrent._bwd_dkv",
                                           "gated_deltanet._fwd", "gated_deltanet._bwd",
                                           "gated_deltanet._ut_fwd", "gated_deltanet._ut_bwd"}
    assert {r["inputs"] for r in rows} == {"fp32", "bf16"}
    assert {r["constexprs"]["BK"] for r in rows} == {64, 128, 256}
    assert_fit(rows)


@pytest.mark.slow  # pip-installs the GPU image's Triton (190 MB) into a throwaway folder
@needs_ptxas
def test_the_survey_compiles_with_the_gpu_images_triton_from_a_throwaway_folder(tmp_path):
    """The lent GPU has Triton 3.6 while CI has a newer one, and shared memory moves between
    versions: the survey compiles with the Triton found in --triton-site instead of its own."""
    site = tmp_path / "site"
    done = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(site), "triton==3.6.0"],
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    rows = survey(tmp_path, "--triton-site", str(site), "--presets", "minimax-text-01", "--widths", "", "--dtypes", "bf16",
                  "--kernels", "recurrent._fwd", "--first-config")
    assert {r["triton"] for r in rows} == {"3.6.0"}
    assert_fit(rows)


def test_the_survey_refuses_a_folder_without_triton(tmp_path):
    done = subprocess.run([sys.executable, "-m", "zoo.tools.kernel_fit", "--triton-site", str(tmp_path)],
                          capture_output=True, text=True)
    assert done.returncode != 0 and f"--triton-site {tmp_path}: no triton package there" in done.stderr

"""The oldest versions zoo's runtime supports (pyproject's floors: Triton >= 3.6 and transformers >=
5.17, the lent GPU image's) installed into a throwaway folder ahead of this environment's, and a
representative part of the suite run with them: the Triton kernels under the interpreter and the
fused loss, and the specs of the presets. The parity tests pin their own
transformers and are left out. torch's floor, 2.11, is the GPU image's own: benchmarks/gpu_check.sh
prints it and runs the CUDA tests on it (PyPI carries no CPU build of torch for this machine)."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def floors():
    """``{name: version}`` from pyproject's ``>=`` floors of triton and transformers."""
    text = (ROOT / "pyproject.toml").read_text()
    found = {}
    for name in ("triton", "transformers", "torch"):
        versions = re.findall(rf'"{name}>=([0-9.]+)', text)
        assert versions, f"pyproject.toml states no floor for {name}"
        assert len(set(versions)) == 1, f"pyproject.toml states several floors for {name}: {versions}"
        found[name] = versions[0]
    return found


def test_pyproject_states_the_gpu_images_versions_as_floors():
    assert floors() == {"triton": "3.6", "transformers": "5.17", "torch": "2.11"}


@pytest.mark.slow  # pip-installs Triton 3.6 (190 MB), transformers 5.17 and their needs into a throwaway folder
def test_the_runtime_works_with_the_floor_versions(tmp_path):
    f = floors()
    site = tmp_path / "site"
    # with their dependencies (transformers 5.17 needs httpx, which later ones do not), never torch
    done = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--target", str(site),
                           f"triton=={f['triton']}.*", f"transformers=={f['transformers']}.*"],
                          capture_output=True, text=True)
    if done.returncode and ("No matching distribution" in done.stderr or "Could not find" in done.stderr):
        pytest.skip(f"no wheel of the floors for this Python: {done.stderr[-300:]}")
    assert done.returncode == 0, done.stderr[-2000:]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")])}
    probe = subprocess.run([sys.executable, "-c", "import triton, transformers; print(triton.__version__, transformers.__version__)"],
                           env=env, capture_output=True, text=True, cwd=tmp_path)
    assert probe.stdout.split() == [f"{f['triton']}.0", f"{f['transformers']}.0"], probe.stdout + probe.stderr
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "not slow and not parity",
                          "tests/kernels/test_kernels.py", "-k", "rmsnorm or rope or gated_product or fused_linear or ignored_rows",
                          "tests/core/test_spec.py"],
                         env=env, capture_output=True, text=True, cwd=ROOT)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]

"""The oldest versions zoo's runtime supports are the lent GPU image's (torch 2.11, Triton 3.6,
transformers 5.17; the parity tests pin their own transformers): pyproject states them as floors,
and benchmarks/gpu_check.sh prints the versions it runs the CUDA tests on."""

import re
from pathlib import Path

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

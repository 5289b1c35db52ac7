"""benchmarks/gpu_training.py needs GPUs to measure; on the CPU it parses, says what it needs, and its dry run
(two gloo processes, tiny widths) runs every layout two processes allow end to end, with parity."""

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "gpu_training.py"


def _bench():
    spec = importlib.util.spec_from_file_location("gpu_training", SCRIPT)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    return bench


def test_help_parses():
    done = subprocess.run([sys.executable, str(SCRIPT), "--help"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and "--dry-run" in done.stdout and "--layouts" in done.stdout


@pytest.mark.skipif(torch.cuda.is_available(), reason="with a GPU the script measures instead")
def test_without_a_gpu_it_says_so():
    bench = _bench()
    with pytest.raises(SystemExit, match="needs CUDA devices"):
        bench.main(bench.parse_args([]))


@pytest.mark.slow
def test_dry_run_trains_every_layout_and_matches_one_process(tmp_path):
    bench = _bench()
    out, md = tmp_path / "gpu_training.json", tmp_path / "gpu_training.md"
    result = bench.main(bench.parse_args(["--dry-run", "--json", str(out), "--markdown", str(md)]))
    rows = {r["layout"]: r for r in result["rows"]}
    assert result["processes"] == 2 and rows["fsdp_tp"]["skipped"] == "not on 2 processes"
    for name in ("one", "fsdp", "tp", "fsdp_ep"):
        assert rows[name]["worst_gradient_error"] <= 4, rows[name]
        assert rows[name]["tokens_per_s"] > 0
    assert json.loads(out.read_text()) == result
    table = md.read_text().splitlines()
    assert table[0] == "cpu (dry run, gloo), 2 processes" and table[2].startswith("| layout |")
    assert [line.split(" | ")[0] for line in table[4:]] == ["| one", "| fsdp", "| tp", "| fsdp_tp", "| fsdp_ep"]

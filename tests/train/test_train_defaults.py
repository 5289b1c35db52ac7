"""What a user gets without asking: periodic checkpoints, and runs that stay out of git status."""

import shutil
import subprocess
from pathlib import Path

import pytest

from zoo.training.config import TrainConfig

ROOT = Path(__file__).resolve().parents[2]


def test_a_default_run_saves_periodically():
    config = TrainConfig()
    assert 0 < config.save_every < config.steps  # a run killed midway resumes from a recent step


def test_the_default_output_folder_is_ignored_by_git():
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("not a git checkout")
    out = Path(TrainConfig().out_dir)
    assert not out.is_absolute()
    probe = ROOT / out / "checkpoints" / "step-0000100" / "model.safetensors"
    ignored = subprocess.run(["git", "check-ignore", "-q", "--no-index", str(probe)], cwd=ROOT)
    assert ignored.returncode == 0, f"{probe} would show in git status"

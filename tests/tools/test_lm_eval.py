"""The lm-evaluation-harness adapter (zoo.tools.harness): lm_eval's ``zoo`` model scores and
generates what lm_eval's own ``hf`` model does on the same checkpoint, on local task files
(multiple choice, a rolling log-likelihood, generation until a stop sequence), offline."""

import json
import os
import sys

import pytest
import torch

pytest.importorskip("lm_eval", reason="the lm-evaluation-harness is the optional extra: pip install 'zoo-lm[lmeval]'")
pytest.importorskip("transformers")
import lm_eval  # noqa: E402
from lm_eval.tasks import TaskManager  # noqa: E402
from tokenizers import AddedToken, processors  # noqa: E402
from tokenizers import Tokenizer as HFTokenizer  # noqa: E402

import zoo
import zoo.tools.harness  # noqa: E402,F401  (registers the "zoo" model)
from hf_pairs import assert_within_reference_error  # noqa: E402
from test_cli_generate import byte_tokenizer  # noqa: E402
from zoo.checkpoints import tiny  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")

MAX_LENGTH = 40  # short enough that a long context is cut on the left and a document takes several windows
BOS, EOS = 256, 257

CHOICE_DOCS = [
    {"question": "Which letter comes first?", "choices": ["a", "b", "c"], "answer": 0},
    {"question": "Two plus two is", "choices": [" four", " five", " twenty-two"], "answer": 0},
    {"question": "A question far longer than the model's window, so that its context must be cut on the left "
                 "before the answer is scored:", "choices": [" yes", " no"], "answer": 1},
    {"question": "Colour of the sky:", "choices": [" blue", " green", " red", " x"], "answer": 0},
]
ROLLING_DOCS = [{"text": "The json module encodes and decodes JSON; it follows the API of marshal and pickle, "
                         "and a document this long takes several windows of the model."},
                {"text": "Short."}]
GEN_DOCS = [{"prompt": "Once upon a time", "answer": "x"}, {"prompt": "def f(x):", "answer": "y"},
            {"prompt": "A longer prompt than the others, so that the batch is left-padded", "answer": "z"}]
STOPS = ["e", "\n"]  # "e": frequent enough in the random model's output that the stop sequence is reached
GEN_TOKENS = 12


def tokenizer_with_specials() -> HFTokenizer:
    """Bytes as tokens (any text round-trips), with <s> put before every text and </s> the end of text."""
    tok = byte_tokenizer()
    tok.add_special_tokens([AddedToken("<s>", special=True), AddedToken("</s>", special=True)])
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", BOS)])
    return tok


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    d = tmp_path_factory.mktemp("llama")
    tiny.make_tiny("llama", d, overrides={"vocab_size": 258, "bos_token_id": BOS, "eos_token_id": EOS})
    tokenizer_with_specials().save(str(d / "tokenizer.json"))
    (d / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>"}))
    return d


def with_greedy_choices(checkpoint):
    """CHOICE_DOCS, each with one more choice where the reference model's own most likely next
    token after the question (within MAX_LENGTH) is a printable character: a continuation that
    greedy decoding gives."""
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    tok = HFTokenizer.from_file(str(checkpoint / "tokenizer.json"))
    docs = []
    for doc in CHOICE_DOCS:
        ids = tok.encode(doc["question"]).ids[-MAX_LENGTH:]
        with torch.no_grad():
            char = tok.decode([int(hf(torch.tensor([ids])).logits[0, -1].argmax())])
        docs.append({**doc, "choices": doc["choices"] + [char]} if char.isascii() and char.isprintable() else doc)
    return docs


def write_tasks(d, choice_docs, rolling_docs=ROLLING_DOCS, gen_docs=GEN_DOCS, stops=STOPS, gen_tokens=GEN_TOKENS):
    """Three task files over local JSON lines, read by the datasets library's json builder."""
    for name, docs in (("choice", choice_docs), ("rolling", rolling_docs), ("gen", gen_docs)):
        (d / f"{name}.jsonl").write_text("".join(json.dumps(doc) + "\n" for doc in docs))
    common = "dataset_path: json\ntest_split: train\n"
    (d / "choice.yaml").write_text(
        f"task: zoo_choice\n{common}dataset_kwargs:\n  data_files: {{train: {d / 'choice.jsonl'}}}\n"
        "output_type: multiple_choice\ndoc_to_text: '{{question}}'\ndoc_to_choice: '{{choices}}'\n"
        "doc_to_target: answer\ntarget_delimiter: ''\nmetric_list:\n  - metric: acc\n  - metric: acc_norm\n")
    (d / "rolling.yaml").write_text(
        f"task: zoo_rolling\n{common}dataset_kwargs:\n  data_files: {{train: {d / 'rolling.jsonl'}}}\n"
        "output_type: loglikelihood_rolling\ndoc_to_text: ''\ndoc_to_target: '{{text}}'\n"
        "metric_list:\n  - metric: word_perplexity\n  - metric: bits_per_byte\n")
    (d / "gen.yaml").write_text(
        f"task: zoo_gen\n{common}dataset_kwargs:\n  data_files: {{train: {d / 'gen.jsonl'}}}\n"
        "output_type: generate_until\ndoc_to_text: '{{prompt}}'\ndoc_to_target: '{{answer}}'\n"
        f"generation_kwargs:\n  until: {json.dumps(stops)}\n  max_gen_toks: {gen_tokens}\n  do_sample: false\n"
        "metric_list:\n  - metric: exact_match\n")
    return d


@pytest.fixture(scope="module")
def choice_docs(checkpoint):
    return with_greedy_choices(checkpoint)


@pytest.fixture(scope="module")
def tasks(tmp_path_factory, choice_docs):
    return write_tasks(tmp_path_factory.mktemp("tasks"), choice_docs)


@pytest.fixture(scope="module")
def offline():
    saved = {k: os.environ.get(k) for k in ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE")}
    os.environ.update({k: "1" for k in saved})
    yield
    for k, v in saved.items():
        os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)


def evaluate(model, model_args, tasks, batch_size, names=("zoo_choice", "zoo_rolling", "zoo_gen"), **kw):
    """lm_eval's own evaluation of the tasks, with every document's responses logged."""
    return lm_eval.simple_evaluate(model=model, model_args=model_args, tasks=list(names),
                                  task_manager=TaskManager(include_path=str(tasks), include_defaults=False),
                                  batch_size=batch_size, device="cpu", log_samples=True, **kw)


def responses(out, task):
    """Each document's raw responses, in document order."""
    return [s["resps"] for s in sorted(out["samples"][task], key=lambda s: s["doc_id"])]


@pytest.fixture(scope="module")
def runs(checkpoint, tasks, offline):
    args = {"pretrained": str(checkpoint), "max_length": MAX_LENGTH}
    return {"zoo": evaluate("zoo", args, tasks, batch_size=3),
            "hf": evaluate("hf", {**args, "dtype": "float32"}, tasks, batch_size=1),
            "hf64": evaluate("hf", {**args, "dtype": "float64"}, tasks, batch_size=1)}


def test_the_task_files_reach_left_truncation_and_several_windows(checkpoint):
    from zoo.inference.tokenizer import Tokenizer

    tok = Tokenizer(checkpoint)
    assert len(tok.encode(CHOICE_DOCS[2]["question"])) > MAX_LENGTH
    assert len(tok.encode(ROLLING_DOCS[0]["text"])) > 2 * MAX_LENGTH
    assert len(tok.encode(GEN_DOCS[2]["prompt"])) > MAX_LENGTH - GEN_TOKENS


@pytest.mark.parity
def test_loglikelihoods_equal_the_hf_model_within_its_own_float32_error(runs, choice_docs):
    for task in ("zoo_choice", "zoo_rolling"):
        def flat(run):
            values = [r[0] for doc in responses(runs[run], task) for r in doc]
            return torch.tensor([v[0] if isinstance(v, (list, tuple)) else v for v in values], dtype=torch.float64)

        got, ref, exact = flat("zoo"), flat("hf"), flat("hf64")
        assert got.numel() == (sum(len(d["choices"]) for d in choice_docs) if task == "zoo_choice"
                               else len(ROLLING_DOCS))
        assert_within_reference_error(got, ref, exact, factor=4.0, what=f"{task} log-likelihoods")
    greedy = {run: [[r[0][1] for r in doc] for doc in responses(runs[run], "zoo_choice")] for run in runs}
    assert greedy["zoo"] == greedy["hf"] == greedy["hf64"]
    added = [flags[-1] for flags, doc, plain in zip(greedy["zoo"], choice_docs, CHOICE_DOCS) if doc != plain]
    assert added and all(added)  # the choices that are the model's own greedy token
    for metric in ("acc,none", "acc_norm,none"):
        assert runs["zoo"]["results"]["zoo_choice"][metric] == runs["hf"]["results"]["zoo_choice"][metric]


@pytest.mark.parity
def test_generations_equal_the_hf_model(runs, checkpoint):
    got, want = responses(runs["zoo"], "zoo_gen"), responses(runs["hf"], "zoo_gen")
    assert got == want
    texts = [doc[0][0] for doc in got]
    assert len(texts) == len(GEN_DOCS)
    # Each is the greedy continuation of the prompt's last MAX_LENGTH - GEN_TOKENS tokens (the long
    # one is cut) up to its first stop sequence, and the stop comes within the budget at least once.
    from zoo.inference.tokenizer import Tokenizer

    tok, model, reached = Tokenizer(checkpoint), zoo.from_pretrained(checkpoint), 0
    for doc, text in zip(GEN_DOCS, texts):
        ids = torch.tensor([tok.encode(doc["prompt"])[-(MAX_LENGTH - GEN_TOKENS):]])
        full = tok.decode(zoo.generate(model, ids, GEN_TOKENS, stop=EOS)[0, ids.shape[1]:].tolist(),
                          skip_special_tokens=False)
        cut = min([full.index(s) for s in STOPS + ["</s>"] if s in full], default=len(full))
        assert text == full[:cut]
        reached += cut < len(full)
    assert reached


def test_bad_model_args_and_generation_settings_are_named_and_sampling_reaches_generate(checkpoint):
    from zoo.tools.harness import ZooLM

    with pytest.raises(ValueError, match="takes no trust_remote_code"):
        ZooLM(pretrained=str(checkpoint), trust_remote_code=True)
    with pytest.raises(ValueError, match="batch_size must be a positive integer, got 'auto'"):
        ZooLM(pretrained=str(checkpoint), batch_size="auto")
    with pytest.raises(ValueError, match="give pretrained=PATH"):
        ZooLM()
    from lm_eval.api.instance import Instance

    lm = ZooLM(pretrained=str(checkpoint), max_length=MAX_LENGTH)

    def request(**settings):
        return [Instance(request_type="generate_until", doc={}, arguments=("Hello", {"until": ["\n"], **settings}),
                         idx=0)]

    with pytest.raises(ValueError, match="not num_beams"):
        lm.generate_until(request(num_beams=4))
    with pytest.raises(ValueError, match=f"max_gen_toks {MAX_LENGTH} leaves no room for a context within max_length"):
        lm.generate_until(request(max_gen_toks=MAX_LENGTH))
    # Sampling settings reach zoo.generate: sampling among the top 1 is greedy, at a temperature that
    # would otherwise wander.
    torch.manual_seed(0)
    greedy = lm.generate_until(request(until=[], max_gen_toks=8))
    assert lm.generate_until(request(until=[], max_gen_toks=8, do_sample=True, temperature=5.0, top_k=1)) == greedy
    assert lm.generate_until(request(until=[], max_gen_toks=8, do_sample=True, temperature=5.0)) != greedy


@pytest.mark.slow  # lm_eval's command line indexes its thousands of built-in task files first (about 10 s)
def test_zoo_lm_eval_runs_lm_evals_command_line_with_the_zoo_model(checkpoint, tasks, runs, monkeypatch, tmp_path):
    from zoo.cli import main

    monkeypatch.setattr(sys, "argv", ["zoo"])  # lm_eval's command line reads sys.argv, which it is given
    out = tmp_path / "out"
    assert main(["lm-eval", "--model", "zoo", "--model_args", f"pretrained={checkpoint},max_length={MAX_LENGTH}",
                 "--tasks", f"{tasks / 'choice.yaml'},{tasks / 'rolling.yaml'}", "--device", "cpu", "--batch_size", "2",
                 "--output_path", str(out)]) == 0
    (result,) = out.rglob("results_*.json")
    got = json.loads(result.read_text())["results"]
    want = runs["zoo"]["results"]
    assert got["zoo_choice"]["acc,none"] == want["zoo_choice"]["acc,none"]
    assert got["zoo_rolling"]["word_perplexity,none"] == pytest.approx(want["zoo_rolling"]["word_perplexity,none"],
                                                                       rel=1e-5)


SMOL_CHOICES = [
    {"question": "The capital of France is", "choices": [" Paris", " Berlin", " Madrid"], "answer": 0},
    {"question": "Python's json module", "choices": [" encodes and decodes JSON", " draws pictures"], "answer": 0},
    {"question": "Water freezes at zero degrees", "choices": [" Celsius", " Kelvin"], "answer": 0},
]
SMOL_GEN = [{"prompt": "The capital of France is", "answer": " Paris"},
            {"prompt": "def add(a, b):\n    return", "answer": " a + b"}]


@pytest.mark.slow  # two loads of a 135M model (transformers' GGUF loader: about 30 s) and three evaluations
@pytest.mark.parity
def test_the_real_smollm2_gguf_scores_and_generates_as_the_hf_model(tmp_path, offline):
    import copy

    import transformers
    from lm_eval.models.huggingface import HFLM
    from test_gguf_smollm2 import TEXT, smollm2_file

    path = smollm2_file()
    tasks = write_tasks(tmp_path, SMOL_CHOICES, rolling_docs=[{"text": TEXT[:700]}], gen_docs=SMOL_GEN,
                        stops=["\n", "."], gen_tokens=16)
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32,
                                                           attn_implementation="eager").eval()
    hf_tok = transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    zoo_args, hflm = {"pretrained": str(path), "dtype": "float32"}, HFLM(pretrained=hf, tokenizer=hf_tok, batch_size=1)
    runs = {"zoo": evaluate("zoo", zoo_args, tasks, batch_size=2),
            "hf": evaluate(hflm, None, tasks, batch_size=None),
            "hf64": evaluate(HFLM(pretrained=copy.deepcopy(hf).double(), tokenizer=hf_tok, batch_size=1), None, tasks,
                             batch_size=None)}
    for task in ("zoo_choice", "zoo_rolling"):
        def flat(run):
            values = [r[0] for doc in responses(runs[run], task) for r in doc]
            return torch.tensor([v[0] if isinstance(v, (list, tuple)) else v for v in values], dtype=torch.float64)

        assert_within_reference_error(flat("zoo"), flat("hf"), flat("hf64"), factor=4.0, what=f"{task} log-likelihoods")
    # A trained model knows these.
    assert runs["zoo"]["results"]["zoo_choice"]["acc,none"] == runs["hf"]["results"]["zoo_choice"]["acc,none"] == 1.0
    texts = [doc[0][0] for doc in responses(runs["zoo"], "zoo_gen")]
    assert texts == [doc[0][0] for doc in responses(runs["hf"], "zoo_gen")]
    assert texts[0].strip() == "Paris", texts
    # Through the file's chat template (each prompt a user's turn), other answers, the same in both.
    chats = [[doc[0][0] for doc in responses(evaluate(model, args, tasks, batch_size=bs, names=["zoo_gen"],
                                                      apply_chat_template=True), "zoo_gen")]
             for model, args, bs in (("zoo", zoo_args, 2), (hflm, None, None))]
    assert chats[0] == chats[1] and chats[0] != texts and all(chats[0]), chats


def test_zoo_lm_eval_defaults_to_the_device_zoo_would_use(monkeypatch):
    """lm_eval's command line defaults to cuda:0, which fails on a machine without CUDA: zoo passes the
    device it would use unless --device is given."""
    import lm_eval.__main__ as lm_main

    from zoo.tools import harness

    seen = []
    monkeypatch.setattr(lm_main, "cli_evaluate", lambda: seen.append(list(sys.argv)))
    monkeypatch.setattr(sys, "argv", ["zoo"])
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    harness.main(["--model", "zoo", "--tasks", "x"])
    harness.main(["--model", "zoo", "--device", "cuda:1"])
    harness.main(["--model", "zoo", "--device=mps"])
    assert seen == [["lm-eval", "--model", "zoo", "--tasks", "x", "--device", "cpu"],
                    ["lm-eval", "--model", "zoo", "--device", "cuda:1"], ["lm-eval", "--model", "zoo", "--device=mps"]]

"""zoo models in EleutherAI's lm-evaluation-harness (``pip install 'zoo-lm[lmeval]'``).

Importing this module registers the model class ``zoo`` with lm_eval, which finds models only
by its own registry (it reads no plugin entry points), so the command line goes through zoo:

    zoo lm-eval --model zoo --model_args pretrained=model.gguf,dtype=float32 --tasks hellaswag
    python -m zoo.tools.harness --model zoo --model_args pretrained=DIR --tasks my_task --include_path tasks/

and Python imports it before asking lm_eval for ``"zoo"``:

    >>> import lm_eval, zoo.tools.harness
    >>> lm_eval.simple_evaluate(model="zoo", model_args={"pretrained": "model.gguf"}, tasks=["my_task"])
    >>> lm_eval.simple_evaluate(model=zoo.tools.harness.ZooLM(model=model, tokenizer=tokenizer), tasks=[...])

The model and its tokenizer load as ``zoo.from_pretrained`` and ``zoo eval`` load them (a
checkpoint directory, a hub repo id, a training run, a GGUF file); generation is
:func:`zoo.generate`. Requests are scored as lm_eval's own ``hf`` model scores them: the same
tokenisation of context and continuation, the same left truncation to ``max_length``, the same
rolling windows, the same stop sequences, so the two give the same numbers on the same weights.
"""

from __future__ import annotations

import sys
from typing import Optional

import torch

try:
    from lm_eval.api.model import TemplateLM
    from lm_eval.api.registry import register_model
    from lm_eval.models.utils import Collator, handle_stop_sequences, normalize_gen_kwargs, postprocess_generated_text
    from lm_eval.utils import get_rolling_token_windows, make_disjoint_window
except ImportError as exc:  # the optional extra is not installed
    raise ImportError(f"zoo's lm-evaluation-harness adapter needs lm_eval ({exc}): pip install 'zoo-lm[lmeval]'") from None
from tqdm import tqdm

from zoo.checkpoints import from_pretrained, open_source
from zoo.inference.conversation import render
from zoo.inference.generate import Generation, generate
from zoo.inference.tokenizer import Tokenizer

# The generation settings zoo.generate takes from a task's generation_kwargs; any other is refused.
_SAMPLING = ("do_sample", "temperature", "top_k", "top_p")


class _Stopped(Exception):
    """Raised from generate's callback once every row holds a stop sequence."""


@register_model("zoo")
class ZooLM(TemplateLM):
    """A zoo model for lm_eval: ``pretrained`` (what ``zoo.from_pretrained`` loads; its tokenizer
    comes from the same place) or an already built ``model`` with its ``tokenizer``.

    ``dtype``: load the weights as this (``float32``, ``bfloat16``, ...; ``auto``: as stored, GGUF
    float32). ``device``: where the model runs (``cpu``, ``cuda``, ``cuda:1``). ``batch_size``:
    requests per forward. ``max_length``: the longest sequence scored or generated into (default
    the model's ``max_seq_len``); longer contexts lose tokens on the left, as in lm_eval's ``hf``
    model. ``max_gen_toks``: the default generation budget of a task that sets none.
    ``add_bos_token`` / ``prefix_token_id``: as in the ``hf`` model (the token an empty context
    becomes: BOS, else the end-of-text token).
    """

    def __init__(self, pretrained: Optional[str] = None, *, model=None, tokenizer=None, dtype: Optional[str] = None,
                 device: Optional[str] = None, batch_size: int | str = 1, max_batch_size: Optional[int] = None,
                 max_length: Optional[int] = None, max_gen_toks: int = 256, add_bos_token: Optional[bool] = None,
                 prefix_token_id: Optional[int] = None, **unknown):
        super().__init__()
        if unknown:
            raise ValueError(
                f"model_args: the zoo model takes no {', '.join(sorted(unknown))}; it takes pretrained, dtype, "
                "device, batch_size, max_length, max_gen_toks, add_bos_token, prefix_token_id")
        if (pretrained is None) == (model is None):
            raise ValueError("model_args: give pretrained=PATH (a checkpoint directory, hub repo id or GGUF file), "
                             "or pass model= and tokenizer= from Python")
        if model is not None and tokenizer is None:
            raise ValueError("ZooLM(model=...) needs its tokenizer= (a zoo.inference.tokenizer.Tokenizer)")
        if pretrained is not None:
            source = open_source(pretrained)
            tokenizer = Tokenizer(source)
            model = from_pretrained(source, dtype=None if dtype in (None, "auto") else dtype, device=device,
                                    progress=False)
        elif dtype not in (None, "auto"):
            raise ValueError("model_args: dtype applies to pretrained=; convert a model you pass yourself")
        if device is not None:
            model = model.to(device)
        self.model, self.tokenizer = model.eval(), tokenizer
        self._device = next(model.parameters()).device
        self.pretrained = str(pretrained) if pretrained is not None else None
        self.batch_size_per_gpu = self._positive("batch_size", batch_size)  # max_batch_size bounds only "auto"
        self.max_length = (self._positive("max_length", max_length) if max_length is not None
                           else model.spec.max_seq_len)
        self.max_gen_toks = self._positive("max_gen_toks", max_gen_toks)
        self.add_bos_token = add_bos_token
        self.custom_prefix_token_id = prefix_token_id

    @staticmethod
    def _positive(name: str, value) -> int:
        if isinstance(value, str) and value.isdigit():
            value = int(value)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"model_args: {name} must be a positive integer, got {value!r}"
                             + (" (the zoo model takes a fixed batch size)" if name == "batch_size" else ""))
        return value

    # -- tokens ---------------------------------------------------------------------------------

    @property
    def device(self) -> torch.device:
        return self._device

    @property
    def eot_token_id(self) -> int:
        if not self.tokenizer.eos_token_ids:
            raise ValueError(f"the tokenizer ({self.tokenizer.path}) names no end-of-sequence token; lm_eval needs "
                             "one (set eos_token_id in generation_config.json, or pass prefix_token_id=)")
        return self.tokenizer.eos_token_ids[0]

    @property
    def prefix_token_id(self) -> int:
        if self.custom_prefix_token_id is not None:
            return self.custom_prefix_token_id
        bos = self.tokenizer.bos_token
        bos_id = self.tokenizer.tok.token_to_id(bos) if bos is not None else None
        return bos_id if bos_id is not None else self.eot_token_id

    @property
    def tokenizer_name(self) -> str:
        return str(self.tokenizer.path).replace("/", "__")

    def tok_encode(self, string: str, add_special_tokens: Optional[bool] = None, **kwargs) -> list[int]:
        if add_special_tokens is None:  # as the hf model: its own add_bos_token, never a second BOS
            add_special_tokens = True if self.add_bos_token is None else self.add_bos_token
            if string.startswith(self.tok_decode([self.prefix_token_id], skip_special_tokens=False)):
                add_special_tokens = False
        return self.tokenizer.encode(string, add_special_tokens=add_special_tokens)

    def tok_decode(self, tokens, skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(tokens, skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, chat_history: list[dict], add_generation_prompt: bool = True) -> str:
        if not self.tokenizer.chat_template:
            raise ValueError(f"--apply_chat_template: the tokenizer ({self.tokenizer.path}) has no chat template")
        return render(self.tokenizer.chat_template, chat_history, add_generation_prompt=add_generation_prompt,
                      bos_token=self.tokenizer.bos_token or "")

    def get_model_info(self) -> dict:
        return {"model_num_parameters": self.model.num_parameters(),
                "model_dtype": str(next(self.model.parameters()).dtype), "model_source": self.pretrained}

    # -- scoring --------------------------------------------------------------------------------

    @torch.no_grad()
    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs) -> list[tuple[float, bool]]:
        """(sum of log p(continuation | context), whether greedy decoding gives the continuation) for
        each (key, context ids, continuation ids); contexts are cut on the left to fit max_length."""
        # Longest first; requests whose one-token continuations share a context run once (lm_eval's Collator).
        order = Collator(requests, sort_fn=lambda r: (-len(r[1] + r[2]), tuple(r[1] + r[2])), group_by="contexts",
                         group_fn=lambda r: r[-2] + r[-1][:-1])
        res = []
        bar = tqdm(total=len(requests), disable=disable_tqdm, desc="Running loglikelihood requests")
        for chunk in order.get_batched(n=self.batch_size_per_gpu):
            inputs = [(ctx + cont)[-(self.max_length + 1):][:-1] for _, ctx, cont in chunk]
            width = max(map(len, inputs))
            batch = torch.zeros(len(inputs), width, dtype=torch.long)
            for row, ids in zip(batch, inputs):
                row[:len(ids)] = torch.tensor(ids)  # right-padded: a causal model's real positions never see it
            logp = torch.log_softmax(self.model(batch.to(self.device)).float(), dim=-1)
            for (key, ctx, cont), ids, full in zip(chunk, inputs, logp):
                scored = full[len(ids) - len(cont):len(ids)][None]  # the positions that predict the continuation
                greedy = scored.argmax(-1)
                # The requests of this context whose one-token continuations share these log-probabilities:
                for req_key, req_cont, req_scored in order.get_cache(req_str=key, cxt_toks=ctx, cont_toks=cont,
                                                                     logits=scored):
                    want = torch.tensor(req_cont, device=req_scored.device)[None]
                    answer = (float(req_scored.gather(2, want[..., None]).sum()),
                              bool((greedy[:, -want.shape[1]:] == want).all()))
                    res.append(answer)
                    if req_key is not None:  # rolling windows are cached per document, by loglikelihood_rolling
                        self.cache_hook.add_partial("loglikelihood", req_key, answer)
                    bar.update(1)
        bar.close()
        return order.get_original(res)

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        """Each document's total log-likelihood, in disjoint windows of max_length tokens, each window
        conditioned on the end of the one before (lm_eval's rolling windows)."""
        windows, owner = [], []
        for i, (text,) in enumerate(tqdm([r.args for r in requests], disable=disable_tqdm)):
            for window in get_rolling_token_windows(token_list=self.tok_encode(text), prefix_token=self.prefix_token_id,
                                                    max_seq_len=self.max_length, context_len=1):
                windows.append((None, *make_disjoint_window(window)))
                owner.append(i)
        totals = [0.0] * len(requests)
        for i, (ll, _) in zip(owner, self._loglikelihood_tokens(windows, disable_tqdm=True)):
            totals[i] += ll
        for r, total in zip(requests, totals):
            self.cache_hook.add_partial("loglikelihood_rolling", r.args, total)
        return totals

    # -- generation -----------------------------------------------------------------------------

    @torch.no_grad()
    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        """Greedy (or sampled, as the task says) continuations by zoo.generate, each cut at the first
        of the task's stop sequences and the end-of-text token, batched among requests that share
        their generation settings."""
        order = Collator([r.args for r in requests], sort_fn=lambda r: (-len(self.tok_encode(r[0])), r[0]),
                         group_by="gen_kwargs", group_fn=lambda r: r[1])
        eos = self.tok_decode([self.eot_token_id], skip_special_tokens=False)
        res = []
        bar = tqdm(total=len(requests), disable=disable_tqdm, desc="Running generate_until requests")
        for chunk in order.get_batched(n=self.batch_size_per_gpu):
            contexts, settings = zip(*chunk)
            kwargs = normalize_gen_kwargs(settings[0], self.max_gen_toks)
            until = handle_stop_sequences(kwargs.pop("until", None), eos=eos)
            budget = kwargs.pop("max_gen_toks")
            unknown = sorted(set(kwargs) - set(_SAMPLING))
            if unknown:
                raise ValueError(f"generation_kwargs: the zoo model takes {', '.join(_SAMPLING)}, until and "
                                 f"max_gen_toks, not {', '.join(unknown)}")
            if budget >= self.max_length:
                raise ValueError(f"generation_kwargs: max_gen_toks {budget} leaves no room for a context within "
                                 f"max_length {self.max_length}")
            # Left-truncated to leave room for the new tokens, left-padded into one batch.
            prompts = [self.tok_encode(c)[-(self.max_length - budget):] for c in contexts]
            width = max(map(len, prompts))
            ids = torch.zeros(len(prompts), width, dtype=torch.long)
            mask = torch.zeros_like(ids)
            for row, m, p in zip(ids, mask, prompts):
                row[width - len(p):], m[width - len(p):] = torch.tensor(p), 1
            new = []

            def watch(column):
                new.append(column.tolist())
                texts = [self.tok_decode(t, skip_special_tokens=False) for t in zip(*new)]
                if all(any(s and s in t for s in until) for t in texts):
                    raise _Stopped  # every row holds a stop sequence: what follows it is cut anyway

            try:
                # the task's settings are transformers' spellings (do_sample, temperature, ...): read here
                asked = Generation.from_transformers(max_new_tokens=budget, stop=self.tokenizer.eos_token_ids,
                                                        callback=watch, **{k: kwargs[k] for k in _SAMPLING if k in kwargs})
                generate(self.model, ids.to(self.device), settings=asked, attention_mask=mask.to(self.device))
            except _Stopped:
                pass
            for i, context in enumerate(contexts):
                text = postprocess_generated_text(self.tok_decode([c[i] for c in new]), stop=until, think_end_token=None)
                res.append(text)
                self.cache_hook.add_partial("generate_until", (context, settings[0]), text)
                bar.update(1)
        bar.close()
        return order.get_original(res)


def default_device() -> str:
    """The device zoo would use: the first GPU when there is one, else the CPU."""
    return "cuda" if torch.cuda.is_available() else "cpu"


def main(argv: Optional[list[str]] = None) -> int:
    """lm_eval's own command line, with the ``zoo`` model registered (``argv``: its arguments)."""
    from lm_eval.__main__ import cli_evaluate

    argv = list(sys.argv[1:] if argv is None else argv)
    if not any(a == "--device" or a.startswith("--device=") for a in argv):
        argv += ["--device", default_device()]  # lm_eval's own default is cuda:0, even on a machine without CUDA
    sys.argv = ["lm-eval", *argv]
    cli_evaluate()
    return 0


if __name__ == "__main__":
    sys.exit(main())

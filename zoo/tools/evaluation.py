"""Perplexity and bits per byte of a model on text, with a sliding window.

The text's tokens are scored window by window, as Hugging Face's strided-perplexity recipe does:
each window holds at most ``window`` tokens and starts ``stride`` tokens after the previous one;
only the tokens a window adds beyond the previous window's end are scored, each conditioned on
everything before it in the window (so every token after the first is scored once, with at
least ``window - stride`` tokens of context once the text is longer than a window).

    >>> result = zoo.evaluation.perplexity(model, ids, window=1024, stride=512)
    >>> result.perplexity, result.bits_per_byte(n_bytes)
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass
class Perplexity:
    nll: torch.Tensor  # (n,) float64: -log p of each scored token, in nats
    window: int
    stride: int

    @property
    def tokens(self) -> int:
        return int(self.nll.numel())

    @property
    def mean_nll(self) -> float:
        return float(self.nll.mean())

    @property
    def perplexity(self) -> float:
        return math.exp(self.mean_nll)

    def bits_per_byte(self, n_bytes: int) -> float:
        """The total negative log-likelihood in bits over the text's UTF-8 bytes."""
        return float(self.nll.sum()) / math.log(2) / n_bytes


def windows(n: int, window: int, stride: int):
    """(begin, end, scored) for each window over ``n`` tokens: the last ``scored`` positions of
    ``[begin, end)`` are the tokens this window adds."""
    if window < 2 or not 1 <= stride <= window:
        raise ValueError(f"window must be at least 2 and stride between 1 and the window, got window {window}, "
                         f"stride {stride}")
    prev_end = 0
    for begin in range(0, n, stride):
        end = min(begin + window, n)
        yield begin, end, end - prev_end
        prev_end = end
        if end == n:
            break


@torch.no_grad()
def perplexity(model, ids, *, window: int, stride: int, progress=None) -> Perplexity:
    """Score token ids ``ids`` (a list or a 1-D tensor) with ``model``; see the module docstring.
    ``progress``: called with the number of tokens each window scores, as it is scored."""
    ids = torch.as_tensor(ids).reshape(-1)
    if ids.numel() < 2:
        raise ValueError("the text has fewer than two tokens: nothing to score")
    limit = model.spec.max_seq_len
    if window > limit:
        raise ValueError(f"window {window} is longer than the model's max_seq_len {limit}")
    device = next(model.parameters()).device
    out = []
    for begin, end, scored in windows(ids.numel(), window, stride):
        chunk = ids[begin:end].to(device)[None]
        logp = torch.log_softmax(model(chunk)[0, :-1].float(), -1)
        nll = -logp.gather(-1, chunk[0, 1:, None])[:, 0]
        out.append(nll[-min(scored, nll.numel()):].double().cpu())  # the first window cannot score its first token
        if progress is not None:
            progress(scored)
    return Perplexity(torch.cat(out), window, stride)

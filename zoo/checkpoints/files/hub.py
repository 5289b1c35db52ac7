"""Local directories and Hugging Face Hub repositories, through huggingface_hub (its cache,
``HF_HUB_OFFLINE``, tokens and revisions behave as its users expect)."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

from zoo.checkpoints.hf.format import CheckpointError

ALLOW_PATTERNS = [
    "config.json", "*.safetensors", "model.safetensors.index.json", "generation_config.json",
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model", "vocab.json",
    "merges.txt",
]


def resolve(path_or_repo: str | Path, *, revision: Optional[str] = None, token=None, cache_dir=None) -> Path:
    """A local checkpoint directory, or the cached snapshot of a hub repo (downloaded if needed)."""
    path = Path(path_or_repo).expanduser()
    if path.is_dir():
        return path
    text = str(path_or_repo)
    if path.exists() or text.startswith((".", "/", "~")) or text.count("/") > 1 or "\\" in text:
        raise CheckpointError(f"{text}: not a checkpoint directory (expected a directory with config.json)")
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import (
        GatedRepoError, LocalEntryNotFoundError, RepositoryNotFoundError, RevisionNotFoundError,
    )

    try:
        return Path(snapshot_download(text, revision=revision, allow_patterns=ALLOW_PATTERNS, token=token,
                                      cache_dir=cache_dir))
    except GatedRepoError:
        raise CheckpointError(f"{text} is gated: accept its licence on the Hub and log in "
                              "(`hf auth login` or HF_TOKEN)") from None
    except RepositoryNotFoundError:
        raise CheckpointError(f"{text}: no such local directory, and no such Hub repository "
                              "(or it is private: log in with `hf auth login` or set HF_TOKEN)") from None
    except RevisionNotFoundError:
        raise CheckpointError(f"{text}: revision {revision!r} does not exist on the Hub") from None
    except LocalEntryNotFoundError as exc:
        raise CheckpointError(
            f"{text}: not a local directory, not in the Hugging Face cache, and the Hub cannot be reached "
            f"(offline: HF_HUB_OFFLINE is set or there is no network). Download it where there is a network "
            f"(`hf download {text}`), or pass a local directory. ({exc})"
        ) from None

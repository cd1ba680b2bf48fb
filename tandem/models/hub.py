"""Hugging Face Hub names (``org/name``) as model directories: the cached snapshot of the files tandem reads.

:func:`snapshot` runs ``huggingface_hub.snapshot_download`` with ``allow_patterns`` for only what
tandem reads (configs, safetensors weights, tokenizer and chat template files; a draft's
``pytorch_model.bin`` too), never ``original/*`` (the consolidated ``.pth`` some repos carry beside).
huggingface_hub itself reads ``HF_TOKEN`` (gated repositories) and falls back to its cache when the
hub cannot be reached. ``HF_HUB_OFFLINE`` and ``HF_HUB_CACHE`` are read at each call (huggingface_hub
reads them once, at import), so a process that sets them later is honoured: offline, only the cache
is looked at (``local_files_only``). Either way a name found nowhere raises FileNotFoundError naming
the repository and the revision.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

TARGET_FILES = (
    "config.json",
    "generation_config.json",
    "*.safetensors",
    "model.safetensors.index.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "tokenizer.model",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
    "chat_template.jinja",
    "chat_template.json",
    "additional_chat_templates/*",
)
DRAFT_FILES = (*TARGET_FILES, "pytorch_model.bin", "pytorch_model.bin.index.json", "pytorch_model-*.bin")
SKIPPED_FILES = ("original/*",)
HUB_NAME = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")  # huggingface_hub's repo id: "org/name"


def is_hub_name(name: str) -> bool:
    """Whether ``name`` reads as a hub repository id (``org/name``) and is not an existing local path."""
    return bool(HUB_NAME.fullmatch(name)) and not Path(name).exists()


def snapshot(repo_id: str, revision: str | None = None, *, files: tuple[str, ...] = TARGET_FILES) -> Path:
    """The local directory of ``repo_id`` at ``revision`` (None: the default branch) holding ``files``
    (glob patterns; :data:`DRAFT_FILES` for a draft): downloaded when online, the cache's snapshot when
    offline or when the hub cannot be reached.

    Raises FileNotFoundError naming the repository and the revision when neither has it (with the hub's
    message: not found, gated without a token, unknown revision).
    """
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError

    offline = _env_true("HF_HUB_OFFLINE") or _env_true("TRANSFORMERS_OFFLINE")
    where = f"model {repo_id!r} (revision {revision or 'main'!r})"
    try:
        path = snapshot_download(
            repo_id,
            revision=revision,
            allow_patterns=list(files),
            ignore_patterns=list(SKIPPED_FILES),
            cache_dir=os.environ.get("HF_HUB_CACHE") or None,
            local_files_only=offline,
        )
    except LocalEntryNotFoundError as error:
        reason = "HF_HUB_OFFLINE is set" if offline else error
        raise FileNotFoundError(
            f"{where}: not in the local cache and the hub could not be reached ({reason})"
        ) from error
    except HfHubHTTPError as error:
        raise FileNotFoundError(f"{where}: {error}") from error
    return Path(path)


def _env_true(name: str) -> bool:
    return os.environ.get(name, "").upper() in ("1", "ON", "YES", "TRUE")

"""A local Hugging Face cache built by the tests, in huggingface_hub's own layout.

``models--org--name/refs/<revision>`` holds a commit hash and ``snapshots/<hash>/`` the files: what
``snapshot_download`` reads when HF_HUB_OFFLINE is set (no blobs or symlinks needed).
"""

from __future__ import annotations

import hashlib
import shutil
from collections.abc import Mapping
from pathlib import Path


def add_cached_repo(cache: Path, repo: str, files: Mapping[str, bytes | Path],
                    revision: str = "main") -> Path:
    """Put ``files`` (repo path → content, or a file to copy) in the cache; returns the snapshot."""
    commit = hashlib.sha1(f"{repo}@{revision}".encode()).hexdigest()
    storage = cache / f"models--{repo.replace('/', '--')}"
    snapshot = storage / "snapshots" / commit
    for name, content in files.items():
        path = snapshot / name
        path.parent.mkdir(parents=True, exist_ok=True)
        if isinstance(content, Path):
            shutil.copyfile(content, path)
        else:
            path.write_bytes(content)
    (storage / "refs").mkdir(exist_ok=True)
    (storage / "refs" / revision).write_text(commit)
    return snapshot

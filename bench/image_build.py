"""Items 17-19: the CPU image, built with buildah (scripts/image.py) and run under the local endpoint.

17. Build time of ``worker-cpu-baked`` (SmolLM2 baked in from a local hub): cold, with no layer
    cached (``--no-cache`` for the CPU base and the worker; the debootstrap Debian and the wheelhouse
    are this machine's stand-ins for a registry and an index, made once, and timed apart when made);
    cached, nothing changed; and after a change under ``src/`` (only the code layer is rebuilt).
18. The image's size, layer by layer, with the instruction that made each.
19. Start-up: the baked image's own command under ``python -m endpoint --image`` (on an empty
    network volume, then on the volume that start published its compile cache to), and the
    checkout's worker under ``python -m endpoint``, same model and settings, in turn: from the
    endpoint's start to its worker's first call for work.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import image

from bench.common import MODELS_ROOT, REPO, Plan, Results, ab, model_env
from bench.servers import FAILED_START_LINES
from dev_env import free_port
from tests.image.local_hub import LocalHub

REPO_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"
TAG = "localhost/worker-vllm-bench:baked"
LAYERS_DB = Path("/var/lib/containers/storage/overlay-layers/layers.json")
# What a history entry says besides its instruction: the build args a RUN saw (`|2 A=x B=y`), the
# shell, `#(nop)` and the digests of copied files.
HISTORY_NOISE = re.compile(r"^\|\d+ (?:\S+=\S* )*|/bin/sh -c |#\(nop\) |(?:file|multi|dir):[0-9a-f]+ ")


def _hub(model: str) -> LocalHub:
    hub = LocalHub()
    hub.add_repo(REPO_ID, {p.name: p for p in (MODELS_ROOT / model).iterdir() if p.is_file()})
    hub.start()
    return hub


def _code_changed_context(folder: Path) -> Path:
    """A build context like the checkout's, with one line added to src/handler.py."""
    with (image.copy_context(folder) / "src" / "handler.py").open("a") as f:
        f.write(f"# changed at {time.time()}\n")
    return folder


def build_times(plan: Plan, overrides: dict[str, str], results: Results) -> None:
    item = "17 build time (worker-cpu-baked)"
    for name, exists, make in (("debootstrap Debian", image.image_exists(image.DEBIAN_BASE), image.ensure_debian_base),
                               ("wheelhouse download", image.wheelhouse_exists(), image.wheelhouse)):
        started = time.monotonic()
        make()
        if not exists:  # made once per machine
            results.figure(item, "-", f"first on this machine: {name}", "s").values.append(
                time.monotonic() - started)
    cold = image.build("worker-cpu-baked", overrides, tag=TAG, no_cache=True)
    results.figure(item, "-", "cold: no layer cached (CPU base and worker)", "s").values.append(cold.seconds)
    for _ in range(plan.reps):
        cached = image.build("worker-cpu-baked", overrides, tag=TAG)
        results.figure(item, "-", "cached: nothing changed", "s").values.append(cached.seconds)
        with tempfile.TemporaryDirectory() as folder:
            changed = image.build("worker-cpu-baked", overrides, tag=f"{TAG}-changed",
                                  context=_code_changed_context(Path(folder)))
        results.figure(item, "-", "after a change under src/", "s").values.append(changed.seconds)


def layer_sizes(results: Results) -> None:
    """Item 18, from the image's history and the size containers-storage records for each layer."""
    config = image.image_config(TAG)
    sizes = {layer["diff-digest"]: layer["diff-size"] for layer in json.loads(LAYERS_DB.read_text())}
    made = [entry.get("created_by", "") for entry in config["history"] if not entry.get("empty_layer")]
    for n, (digest, created_by) in enumerate(zip(config["rootfs"]["diff_ids"], made, strict=True)):
        step = re.sub(HISTORY_NOISE, "", " ".join(created_by.split()))[:70].replace("|", "/")  # a table cell
        results.figure("18 image size per layer", "-", f"{n}: {step}", "MB").values.append(sizes[digest] / 1e6)


def _start(args: list[str], env: dict[str, str], log: Path) -> float:
    """Seconds from ``python -m endpoint`` starting to its worker's first call for work."""
    port = free_port()
    started = time.monotonic()
    proc = subprocess.Popen([sys.executable, "-m", "endpoint", "--port", str(port), *args], cwd=REPO,
                            env=env, stdout=log.open("w"), stderr=subprocess.STDOUT)
    try:
        while True:
            if proc.poll() is not None or any(text in log.read_text() for text in FAILED_START_LINES):
                raise RuntimeError(f"the worker did not start:\n{log.read_text()[-3000:]}")
            try:
                if httpx.get(f"http://127.0.0.1:{port}/v2/local/health").json()["workers"]["ready"]:
                    return time.monotonic() - started
            except httpx.HTTPError:
                pass
            time.sleep(0.05)
    finally:
        proc.terminate()
        proc.wait(timeout=120)


def start_times(model: str, plan: Plan, results: Results, logs: Path) -> None:
    """Item 19. The image starts twice on one volume: empty (a new endpoint's first container), then
    holding what the first start published to its compile cache (vLLM's derived state)."""
    item = "19 start-up: image ÷ checkout"
    env = model_env(model, plan)
    settings = {k: v for k, v in env.items() if k not in ("MODEL_NAME", "VLLM_RPC_BASE_PATH",
                                                          "VLLM_CONFIG_FILE", "LOCAL_MODEL_ARGS_FILE")}
    in_image = ["--image", TAG, *(f"--env={k}={v}" for k, v in settings.items())]

    def image_starts(rep: int) -> tuple[float, float]:
        with tempfile.TemporaryDirectory() as volume:
            args = [*in_image, f"--volume={volume}:/runpod-volume"]
            return (_start(args, env, logs / f"image-empty-{rep}.log"),
                    _start(args, env, logs / f"image-warm-{rep}.log"))

    for rep in range(plan.reps):
        (empty, warm), checkout = ab(rep, lambda: image_starts(rep),
                                     lambda: _start([], env, logs / f"checkout-{rep}.log"))
        for name, seconds in (("image, empty volume", empty), ("image, volume of an earlier start", warm),
                              ("checkout", checkout)):
            results.figure(item, model, f"{name}: endpoint start → worker takes jobs", "s").values.append(seconds)
        results.figure(item, model, "image ÷ checkout, empty volume").values.append(empty / checkout)
        results.figure(item, model, "image ÷ checkout, volume of an earlier start").values.append(warm / checkout)


def run(plan: Plan, results: Results) -> None:
    logs = Path(tempfile.mkdtemp(prefix="bench-image-"))
    model = plan.latency_model
    hub = _hub(model)
    try:
        overrides = {"MODEL_NAME": REPO_ID, "HF_ENDPOINT": hub.url}
        build_times(plan, overrides, results)
    finally:
        hub.stop()
    layer_sizes(results)
    start_times(model, plan, results, logs)

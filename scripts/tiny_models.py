"""The tiny random models the tests serve where content does not matter: fixed seeds, and byte-level
BPE tokenizers trained here on a made-up English-like corpus, so that nothing comes from a hub.

Each ``write_*`` writes one model into an empty folder: a Llama with a ChatML template, a
cross-encoder and a 3-label classifier (Llama sequence classifiers), a Whisper and an Idefics3
vision-language model. ``build_models`` runs them, each into a folder it stamps when complete.
"""

import json
import random
from pathlib import Path

__all__ = ["write_classifier", "write_cross_encoder", "write_tiny_llama", "write_vlm", "write_whisper"]

# ChatML, as SmolLM2 uses, so the tiny model exercises the same chat code paths.
TINY_CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


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


def _byte_bpe(vocab_size: int, specials: list[str]):
    """A byte-level BPE (any UTF-8 text round-trips) trained on _tiny_corpus(); the special tokens
    come first, in the order given."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tk = Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=specials, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tk.train_from_iterator(_tiny_corpus(), trainer=trainer)
    return tk


def _fast_tokenizer(tk, eos: str = "<|eos|>"):
    """A transformers tokenizer around ``tk``, with the tiny models' special tokens."""
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(tokenizer_object=tk, bos_token="<|bos|>", eos_token=eos,
                                   pad_token="<|pad|>", model_max_length=2048)


def _tiny_llama_config(vocab_size: int, bos: int, eos: int, pad: int, **more):
    """The tiny models' text model: Llama, 2 layers, hidden 256, 4 heads (2 for keys and values)."""
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=vocab_size, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                       bos_token_id=bos, eos_token_id=eos, pad_token_id=pad, tie_word_embeddings=False,
                       **more)


def write_tiny_llama(out: Path) -> None:
    """A random-weight Llama (2 layers, hidden 256) with a ChatML template; gibberish output."""
    import torch
    from tokenizers import processors
    from transformers import GenerationConfig, LlamaForCausalLM

    tk = _byte_bpe(2048, ["<|bos|>", "<|eos|>", "<|pad|>", "<|im_start|>", "<|im_end|>"])
    # Like Llama: plain encodes start with BOS (chat prompts get it from the template instead).
    tk.post_processor = processors.TemplateProcessing(
        single="<|bos|> $A",
        pair="<|bos|> $A <|bos|> $B",
        special_tokens=[("<|bos|>", tk.token_to_id("<|bos|>"))],
    )
    tok = _fast_tokenizer(tk)
    tok.chat_template = TINY_CHAT_TEMPLATE
    tok.save_pretrained(out)

    config = _tiny_llama_config(len(tok), tok.bos_token_id, tok.eos_token_id, tok.pad_token_id)
    torch.manual_seed(0)
    LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(out)
    GenerationConfig(
        bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id
    ).save_pretrained(out)



def _write_sequence_classifier(out: Path, labels: list[str] | None) -> None:
    """A random LlamaForSequenceClassification (2 layers, hidden 256, float32): one output per
    label, or a single score (a cross-encoder) when ``labels`` is None.

    Llama rather than BERT: a tiny random BERT's pooler makes every input score about the same
    (0.9751-0.9759 for six documents), while this one spreads them (0.51-0.66), so results differ
    clearly between documents. vLLM pools the last token (<|eos|>) and applies the score head.
    """
    import torch
    from tokenizers import processors
    from transformers import LlamaForSequenceClassification

    tk = _byte_bpe(2048, ["<|bos|>", "<|eos|>", "<|pad|>"])
    bos, eos = tk.token_to_id("<|bos|>"), tk.token_to_id("<|eos|>")
    # A text, or a query/document pair: <|bos|> query <|eos|> document <|eos|>.
    tk.post_processor = processors.TemplateProcessing(
        single="<|bos|> $A <|eos|>",
        pair="<|bos|> $A <|eos|> $B:1 <|eos|>:1",
        special_tokens=[("<|bos|>", bos), ("<|eos|>", eos)],
    )
    tok = _fast_tokenizer(tk)
    tok.save_pretrained(out)

    names = labels or ["LABEL_0"]
    config = _tiny_llama_config(
        len(tok), bos, eos, tok.pad_token_id,
        num_labels=len(names),
        id2label=dict(enumerate(names)),
        label2id={name: i for i, name in enumerate(names)},
        # One label and no problem_type: vLLM applies a sigmoid (scores in (0, 1)), as for a real
        # cross-encoder ("regression" would return raw logits). Several labels: a softmax.
        problem_type="single_label_classification" if labels else None,
    )
    torch.manual_seed(0)
    model = LlamaForSequenceClassification(config).eval()
    # The default head (std 0.02) puts every score near 0.5; std 0.05 spreads them unsaturated.
    torch.nn.init.normal_(model.score.weight, std=0.05)
    model.save_pretrained(out)


def write_cross_encoder(out: Path) -> None:
    """A 1-label sequence classifier (a cross-encoder) for /score and /rerank.

    A separate model from tiny-classifier: vLLM serves /score and /rerank only for one label.
    """
    _write_sequence_classifier(out, labels=None)


def write_classifier(out: Path) -> None:
    """A 3-label sequence classifier (negative/neutral/positive) for /classify."""
    _write_sequence_classifier(out, labels=["negative", "neutral", "positive"])


def write_whisper(out: Path) -> None:
    """A random Whisper (speech to text: /v1/audio/transcriptions and /translations).

    d_model 64, 2+2 layers, 1 head (head size 64, which vLLM's CPU attention supports), 80 mel
    bins, 30 s inputs (max_source_positions 1500) and max_target_positions 128, so a transcript
    stops after about 124 tokens. The feature extractor has Whisper's defaults (its mel filters
    are computed locally). The tokenizer is a byte-level BPE with Whisper's special tokens in
    Whisper's order, then the 1501 timestamp tokens <|0.00|>..<|30.00|> (verbose_json segments).
    Serving audio needs the soundfile package (in the lock), which decodes 16 kHz WAV (also FLAC,
    OGG, MP3); audio at another rate needs PyAV (`av`, not installed) to resample: vLLM answers 400.
    """
    import torch
    from transformers import (GenerationConfig, WhisperConfig, WhisperFeatureExtractor,
                              WhisperForConditionalGeneration, WhisperProcessor, WhisperTokenizer)
    from transformers.models.whisper.tokenization_whisper import LANGUAGES

    bpe = json.loads(_byte_bpe(1000, ["<|endoftext|>"]).to_str())["model"]
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in bpe["merges"]]
    tok = WhisperTokenizer(vocab=bpe["vocab"], merges=merges, model_max_length=448)
    tok.add_special_tokens({"additional_special_tokens": [
        "<|startoftranscript|>", *(f"<|{code}|>" for code in LANGUAGES), "<|translate|>",
        "<|transcribe|>", "<|startoflm|>", "<|startofprev|>", "<|nocaptions|>", "<|notimestamps|>",
    ]})
    tok.add_tokens([f"<|{i * 0.02:.2f}|>" for i in range(1501)])  # not special, as in Whisper
    features = WhisperFeatureExtractor(
        feature_size=80, sampling_rate=16000, hop_length=160, chunk_length=30, n_fft=400
    )
    WhisperProcessor(feature_extractor=features, tokenizer=tok).save_pretrained(out)

    eot, sot = tok.convert_tokens_to_ids(["<|endoftext|>", "<|startoftranscript|>"])
    config = WhisperConfig(
        vocab_size=len(tok), num_mel_bins=80, d_model=64, encoder_layers=2, decoder_layers=2,
        encoder_attention_heads=1, decoder_attention_heads=1, encoder_ffn_dim=128, decoder_ffn_dim=128,
        max_source_positions=1500, max_target_positions=128, pad_token_id=eot, bos_token_id=eot,
        eos_token_id=eot, decoder_start_token_id=sot, suppress_tokens=[], begin_suppress_tokens=[],
        tie_word_embeddings=True)
    torch.manual_seed(0)
    model = WhisperForConditionalGeneration(config).eval()
    # Zero the (tied) embedding rows from <|startoftranscript|> on (languages, tasks, timestamps):
    # their logits are then exactly 0 while the random text logits are not, so greedy decoding
    # emits plain (gibberish) text rather than runs of "<|0.12|>".
    with torch.no_grad():
        model.model.decoder.embed_tokens.weight[sot:] = 0
    model.save_pretrained(out)
    GenerationConfig(
        decoder_start_token_id=sot,
        bos_token_id=eot,
        eos_token_id=eot,
        pad_token_id=eot,
        no_timestamps_token_id=tok.convert_tokens_to_ids("<|notimestamps|>"),
        max_length=128,
    ).save_pretrained(out)


# SmolVLM-like: "User:<image> text<end_of_utterance>\nAssistant:".
VLM_CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{{ message['role'] | capitalize }}:"
    "{% if message['content'] is string %}{{ ' ' + message['content'] }}"
    "{% else %}{% for item in message['content'] %}"
    "{% if item['type'] == 'image' or item['type'] == 'image_url' %}{{ '<image>' }}"
    "{% elif item['type'] == 'text' %}{{ ' ' + item['text'] }}{% endif %}"
    "{% endfor %}{% endif %}{{ '<end_of_utterance>\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ 'Assistant:' }}{% endif %}"
)


def write_vlm(out: Path) -> None:
    """A random Idefics3 (SmolVLM's architecture) for chat with images; gibberish output.

    Idefics3 because vLLM's CPU build serves it without torchvision, which cannot be installed
    here (its wheels are CUDA-linked and break `import vllm`, see lock.sh): vLLM's modules for
    LLaVA, Qwen-VL, Gemma 3, InternVL and most others import torchvision.
    Vision: 32-pixel tiles of 8-pixel patches (hidden 64, 2 layers, 1 head), pixel shuffle 2, so
    4 <image> tokens per tile; text: Llama, 2 layers, hidden 256. The processor uses the PIL image
    backend (Idefics3ImageProcessorPil, no torchvision): an image becomes up to 2x2 tiles plus a
    global image, at most 20 <image> tokens with their tags.
    """
    import torch
    from transformers import (GenerationConfig, Idefics3Config, Idefics3ForConditionalGeneration,
                              Idefics3Processor, Idefics3VisionConfig)
    from transformers.models.idefics3.image_processing_pil_idefics3 import Idefics3ImageProcessorPil

    grid = [f"<row_{i}_col_{j}>" for i in range(1, 7) for j in range(1, 7)]
    specials = ["<|bos|>", "<end_of_utterance>", "<|pad|>", "<fake_token_around_image>",
                "<image>", "<global-img>", *grid]
    tok = _fast_tokenizer(_byte_bpe(2048, specials), eos="<end_of_utterance>")
    tok.chat_template = VLM_CHAT_TEMPLATE

    image_size, patch, scale = 32, 8, 2
    images = Idefics3ImageProcessorPil(size={"longest_edge": 2 * image_size},
                                       max_image_size={"longest_edge": image_size}, do_image_splitting=True)
    processor = Idefics3Processor(image_processor=images, tokenizer=tok, chat_template=VLM_CHAT_TEMPLATE,
                                  image_seq_len=(image_size // patch) ** 2 // scale**2)
    processor.save_pretrained(out)
    tok.save_pretrained(out)  # the chat template in tokenizer_config.json too

    bos, eos, pad, image = tok.convert_tokens_to_ids(
        ["<|bos|>", "<end_of_utterance>", "<|pad|>", "<image>"]
    )
    vision = Idefics3VisionConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                  num_attention_heads=1, image_size=image_size, patch_size=patch)
    text = _tiny_llama_config(len(tok), bos, eos, pad)
    config = Idefics3Config(
        vision_config=vision.to_dict(),
        text_config=text.to_dict(),
        scale_factor=scale,
        image_token_id=image,
        pad_token_id=pad,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    Idefics3ForConditionalGeneration(config).to(torch.bfloat16).save_pretrained(out)
    GenerationConfig(bos_token_id=bos, eos_token_id=eos, pad_token_id=pad).save_pretrained(out)


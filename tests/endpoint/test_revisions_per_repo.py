"""Each repo at its own revision, in one worker process under the local endpoint (issue 47): worker-vllm
rolled back from vLLM 0.29 when first requests failed with RevisionNotFound, a huggingface_hub bug
having applied one repo's pinned revision to another. Here the model is pinned by MODEL_REVISION to a
tag only its repo has, and the worker also takes from the local hub a tokenizer of another repo
(TOKENIZER_NAME, the model's pinned commit has none), a draft model for speculative decoding
(worker-vllm's SPECULATIVE_MODEL) and a LoRA adapter a request names (LORA_HUB_REPOS), none with a
revision of its own. The hub's log says which revision each repo was asked at; a chat through the
other repo's tokenizer and the hub's adapter answers as the same adapter loaded from a folder.
(tests/unit/test_revision_pins.py builds vLLM's configuration for every other way to name them.)"""

from __future__ import annotations

import json

import pytest
from local_endpoint import LocalEndpoint
from test_startup_failures import online
from transformers import AutoTokenizer

from tests.image.local_hub import LocalHub

PIN = "pinned"
CHAT = [{"role": "user", "content": "Once upon a time"}]


@pytest.fixture(scope="module")
def hub(models, tiny_lora):
    """org/tiny (main, and the tag PIN without tokenizer files), org/tok (the tokenizer), org/draft
    (the draft), org/adapter (tiny_lora, for org/tiny); ``hub.commits``: the commit each is served at."""
    files = {p.name: p for p in models["tiny-llama"].iterdir() if not p.name.startswith(".")}
    tokenizer = {name: path for name, path in files.items() if name.startswith(("tokenizer", "chat_"))}
    adapter = {p.name: p.read_bytes() for p in tiny_lora.iterdir()}
    config = json.loads(adapter["adapter_config.json"])
    adapter["adapter_config.json"] = json.dumps({**config, "base_model_name_or_path": "org/tiny"}).encode()
    with LocalHub() as hub:
        hub.add_repo("org/tiny", files)
        weights = {name: path for name, path in files.items() if name not in tokenizer}
        hub.commits = {"org/tiny": (PIN, hub.add_repo("org/tiny", weights, revision="release", tags=[PIN])),
                       "org/tok": ("main", hub.add_repo("org/tok", tokenizer)),
                       "org/draft": ("main", hub.add_repo("org/draft", files)),
                       "org/adapter": ("main", hub.add_repo("org/adapter", adapter))}
        yield hub


def test_each_repo_is_fetched_at_its_own_revision_and_serves(hub, models, tiny_lora, tmp_path):
    env = online(hub, tmp_path, MODEL_NAME="org/tiny", MODEL_REVISION=PIN, TOKENIZER_NAME="org/tok",
                 SPECULATIVE_MODEL="org/draft", NUM_SPECULATIVE_TOKENS="2", DTYPE="float32",
                 ENABLE_LORA="true", LORA_HUB_REPOS="org/adapter", BASE_PATH=str(tmp_path),
                 LORA_MODULES=json.dumps({"name": "from-folder", "path": str(tiny_lora)}))
    endpoint = LocalEndpoint(env, 1, tmp_path / "endpoint.log")
    try:
        client = endpoint.openai_client()

        def chat(model: str):
            return client.chat.completions.create(model=model, messages=CHAT, max_tokens=10, temperature=0,
                                                  extra_body={"ignore_eos": True})

        from_hub, from_folder, base = chat("org/adapter"), chat("from-folder"), chat("org/tiny")
        log = endpoint.log()
    finally:
        endpoint.stop()
    asked = hub.revisions_asked()
    assert asked.keys() == hub.commits.keys()
    for repo, (revision, commit) in hub.commits.items():
        assert asked[repo] <= {revision, commit}, repo
    for repo in ("org/tiny", "org/tok"):  # preflight's (vLLM fetches the draft, the worker the adapter)
        assert f"Model {repo}: ready at commit {hub.commits[repo][1]}" in log
    assert {(d.repo, d.revision) for d in hub.downloads} <= {
        (repo, revision) for repo, pair in hub.commits.items() for revision in pair}
    assert {d.repo for d in hub.downloads if d.path.endswith(".safetensors")} == {"org/tiny", "org/draft",
                                                                                "org/adapter"}

    # The chat went through org/tok's template and tokenizer: org/tiny's pinned commit has neither.
    prompt = AutoTokenizer.from_pretrained(models["tiny-llama"]).apply_chat_template(
        CHAT, add_generation_prompt=True, tokenize=True)
    assert from_hub.usage.prompt_tokens == from_folder.usage.prompt_tokens == len(prompt["input_ids"])
    assert from_hub.choices[0].message.content == from_folder.choices[0].message.content
    assert from_hub.choices[0].message.content != base.choices[0].message.content

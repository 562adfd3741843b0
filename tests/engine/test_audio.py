"""Speech to text on a tiny random Whisper: the JSON job carries the audio (base64 or a data URL)
and the worker builds vLLM's multipart request; the answers equal ``vllm serve``'s for the same
file sent as a multipart upload."""

from __future__ import annotations

import base64
import io
import json
import math
import wave

import pytest
from vllm_server import normalize, vllm_servers


def wav(seconds: float = 1.0, rate: int = 16_000) -> bytes:
    """A 440 Hz tone as 16-bit mono WAV (16 kHz: no resampling, which would need PyAV)."""
    frames = b"".join(int(12_000 * math.sin(2 * math.pi * 440 * i / rate)).to_bytes(2, "little", signed=True)
                      for i in range(int(seconds * rate)))
    buffer = io.BytesIO()
    with wave.open(buffer, "wb") as out:
        out.setnchannels(1)
        out.setsampwidth(2)
        out.setframerate(rate)
        out.writeframes(frames)
    return buffer.getvalue()


AUDIO = wav()
FIELDS = {"temperature": 0, "language": "en"}


@pytest.fixture(scope="module")
def server(whisper_env, tmp_path_factory):
    with vllm_servers({"whisper": whisper_env}, tmp_path_factory.mktemp("vllm-serve")) as clients:
        yield clients["whisper"]


def job(served, **fields) -> dict:
    return {"file": base64.b64encode(AUDIO).decode(), "filename": "tone.wav",
            "model": served.served_model_name, **FIELDS, **fields}


def multipart(server, route: str, **fields):
    data = {name: str(value) for name, value in fields.items()}
    return server.post(route, files={"file": ("tone.wav", AUDIO, "audio/wav")}, data=data)


@pytest.mark.parametrize("route", ["/v1/audio/transcriptions", "/v1/audio/translations"])
def test_audio_routes_answer_as_vllm_serve(whisper_openai, server, run_openai, route):
    (item,) = run_openai(whisper_openai, route, job(whisper_openai))
    assert isinstance(item["text"], str) and item["text"]
    http = multipart(server, route, model=whisper_openai.served_model_name, **FIELDS)
    assert http.status_code == 200 and normalize(item) == normalize(http.json())


def test_a_data_url_and_the_batch_spelling_carry_the_same_file(whisper_openai, run_openai):
    route = "/v1/audio/transcriptions"
    (plain,) = run_openai(whisper_openai, route, job(whisper_openai))
    data_url = "data:audio/wav;base64," + base64.b64encode(AUDIO).decode()
    (from_url,) = run_openai(whisper_openai, route, {**job(whisper_openai), "file": data_url})
    batch = {k: v for k, v in job(whisper_openai).items() if k != "file"} | {"file_url": data_url}
    (from_batch,) = run_openai(whisper_openai, route, batch)
    assert plain["text"] == from_url["text"] == from_batch["text"]


def test_a_streamed_transcription_adds_up_to_the_whole(whisper_openai, run_openai):
    route = "/v1/audio/transcriptions"
    (whole,) = run_openai(whisper_openai, route, job(whisper_openai))
    items = run_openai(whisper_openai, route, job(whisper_openai, stream=True))
    events = [line[5:].strip() for item in items for line in item.splitlines() if line.startswith("data:")]
    assert events[-1] == "[DONE]" and len(events) > 2
    deltas = [json.loads(event)["choices"][0].get("delta", {}).get("content") or ""
              for event in events[:-1] if json.loads(event).get("choices")]
    assert "".join(deltas) == whole["text"]


@pytest.mark.parametrize(("fields", "param"), [({"file": "%%%"}, "file"), ({"file": None}, "file")])
def test_a_bad_upload_is_a_400_naming_the_field(whisper_openai, run_openai, fields, param):
    (item,) = run_openai(whisper_openai, "/v1/audio/transcriptions", {**job(whisper_openai), **fields})
    assert item["error"]["code"] == 400 and item["error"]["param"] == param


def test_audio_vllm_cannot_read_is_vllms_own_400(whisper_openai, server, run_openai):
    garbage = base64.b64encode(b"not audio at all").decode()
    (item,) = run_openai(whisper_openai, "/v1/audio/transcriptions", {**job(whisper_openai), "file": garbage})
    assert item["error"]["code"] == 400

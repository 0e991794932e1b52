"""Text-only stream chunks rendered fast (`streams.TextChunks`) against pydantic's bytes."""
import json

import pytest

from jaxbatch.entrypoints.openai import protocol as P
from jaxbatch.entrypoints.openai.streams import TextChunks, sse

TEXTS = ([chr(c) for c in range(128)]
         + ["", "Hello, world", 'a "quoted" \\ back\\slash', "é ü 日本語 \u2028\u2029 \ufeff",
            "emoji 😀 and \U0001f9e0", "tab\there\r\nnew line", "x" * 5000])


def chat(model):
    return lambda index, text: P.ChatCompletionChunk(
        id="chatcmpl-abc", created=1764892800, model=model,
        choices=[P.ChatStreamChoice(index=index, delta=P.DeltaMessage(content=text))])


def completion(model):
    return lambda index, text: P.CompletionResponse(
        id="cmpl-abc", created=1764892800, model=model,
        choices=[P.CompletionChoice(index=index, text=text)])


@pytest.mark.parametrize("kind", [chat, completion])
@pytest.mark.parametrize("model", ["SmolLM2-135M-Instruct", 'odd "model" \\ ünï', ""])
def test_text_chunks_are_the_bytes_pydantic_writes(kind, model):
    chunk_of = kind(model)
    chunks = TextChunks(chunk_of)
    for index in (0, 1, 3, 0):
        for text in TEXTS:
            assert chunks(index, text) == sse(chunk_of(index, text)), (index, text)


@pytest.mark.parametrize("kind", [chat, completion])
def test_a_model_named_like_the_marker_falls_back_to_pydantic(kind):
    """(Inside a longer JSON string the marker's quotes would be escaped: only a whole value
    equal to it can collide.)"""
    chunk_of = kind(TextChunks._MARK)
    chunks = TextChunks(chunk_of)
    for text in ("hi", TextChunks._MARK, ""):
        line = chunks(0, text)
        assert line == sse(chunk_of(0, text))
        choice = json.loads(line[len("data: "):])["choices"][0]
        assert choice.get("delta", choice).get("content", choice.get("text")) == text

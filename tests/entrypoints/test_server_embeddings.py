"""/v1/embeddings through the official `openai` client against `jaxbatch serve --runner
pooling` on a tiny random Matryoshka checkpoint: text, token ids and batches equal Hugging
Face's pooled hidden states, base64 (the client's default) equals float, `dimensions`
truncates then normalizes, usage counts the prompt tokens; bad input is a 400 with OpenAI's
error body and leaves the server serving."""
from __future__ import annotations

import httpx
import numpy as np
import openai
import pytest

from embedding_models import hf_embedding, write_embedding_checkpoint
from server_utils import ServerProcess

pytestmark = pytest.mark.slow
NAME = "tiny-embed"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    folder = str(tmp_path_factory.mktemp("embed"))
    model = write_embedding_checkpoint("qwen3", folder, "mean", normalize=True,
                                       matryoshka=[16, 32], seed=4)
    proc = ServerProcess(folder, "--runner", "pooling", "--served-model-name", NAME,
                         "--dtype", "float32", "--max-num-seqs", "4", "--max-model-len", "128",
                         "--prefill-chunk-size", "32", "--no-compilation-cache")
    try:
        proc.wait_ready()
        yield proc, model
    finally:
        proc.stop()


def client(proc) -> openai.OpenAI:
    return openai.OpenAI(base_url=proc.base + "/v1", api_key="unused", max_retries=0)


def test_embeddings_through_the_openai_client(server):
    proc, model = server
    texts = ["w5 w6 w7", " ".join(f"w{i}" for i in range(10, 80))]    # 3 and 70 tokens
    ids = [[5, 6, 7], list(range(10, 80))]
    c = client(proc)
    b64 = c.embeddings.create(model=NAME, input=texts)                  # the client: base64
    floats = c.embeddings.create(model=NAME, input=texts, encoding_format="float")
    as_ids = c.embeddings.create(model=NAME, input=ids, encoding_format="float")
    for k, prompt in enumerate(ids):
        ref = hf_embedding(model, prompt, "mean", True)
        np.testing.assert_allclose(b64.data[k].embedding, ref, rtol=1e-4, atol=1e-5)
        assert b64.data[k].embedding == floats.data[k].embedding == as_ids.data[k].embedding
        assert b64.data[k].index == k and b64.data[k].object == "embedding"
    assert b64.usage.prompt_tokens == b64.usage.total_tokens == 73
    single = c.embeddings.create(model=NAME, input=ids[0], dimensions=16)
    assert len(single.data) == 1
    np.testing.assert_allclose(single.data[0].embedding, hf_embedding(model, ids[0], "mean", True, 16),
                               rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("body, param", [
    ({"input": "w5", "dimensions": 20}, "dimensions"),        # not one of the model's
    ({"input": "w5", "encoding_format": "int8"}, "encoding_format"),
    ({"input": ""}, "input"),
    ({"input": [[5], []]}, "input"),
    ({"input": [5, 100000]}, "input"),                         # outside the vocabulary
    ({"input": "w5", "truncate": True}, "truncate"),          # an unknown field
])
def test_bad_input_is_a_400_with_openai_error_body(server, body, param):
    proc, _ = server
    r = httpx.post(proc.base + "/v1/embeddings", json={"model": NAME, **body}, timeout=60)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["code"] == 400 and error["type"] == "BadRequestError" and error["message"]
    assert error["param"] == param, error
    with pytest.raises(openai.BadRequestError):
        client(proc).embeddings.create(model=NAME, input="w5", dimensions=20)
    # ... and the server still serves, with nothing left behind
    assert len(client(proc).embeddings.create(model=NAME, input="w5 w6").data) == 1


def test_a_pooling_server_refuses_to_generate(server):
    proc, _ = server
    r = httpx.post(proc.base + "/v1/completions", json={"model": NAME, "prompt": "w5 w6"},
                   timeout=60)
    assert r.status_code == 400 and "does not generate" in r.json()["error"]["message"]

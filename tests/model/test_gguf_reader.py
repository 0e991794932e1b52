"""The torch-free GGUF reader and tokenizer (model/gguf_reader.py, model/gguf_tokenizer.py)
against transformers' GGUF loading, which needs torch: same config, same tensors, same
tokenizer; and the embedded model loads and generates with torch blocked."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from jaxbatch.model import gguf_reader
from jaxbatch.model.gguf_tokenizer import tokenizer_from_gguf
from jaxbatch.model.loader import embedded_gguf_path, read_gguf_file
from jaxbatch.model.registry import config_from_hf

CHAT = [{"role": "user", "content": "What is the capital of France?"},
        {"role": "assistant", "content": "Paris."},
        {"role": "user", "content": "And of Italy? Answer in one word."}]
TEXTS = ["Hello world!", "  two spaces, a\ttab\n\nand newlines  ", "héllo wörld, naïve café, 日本語",
         "emoji 😀🎉👍🏽 done", "<|im_start|>user\nhi<|im_end|>\n<|endoftext|>tail", "def f(x):\n    return x**2"]


def _hf_model(path):
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(os.path.dirname(path),
                                                gguf_file=os.path.basename(path),
                                                dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def ours():
    return read_gguf_file(embedded_gguf_path())


def _assert_same_as_transformers(hf_config, state, hf_model):
    """Every HF tensor is ours (a tied lm_head is the embedding, not stored twice), and every
    config key we write has HF's value."""
    ref = {k: v.detach().numpy() for k, v in hf_model.state_dict().items()}
    if hf_config["tie_word_embeddings"]:
        np.testing.assert_array_equal(ref.pop("lm_head.weight"), ref["model.embed_tokens.weight"])
    assert sorted(state) == sorted(ref)
    for name, want in ref.items():
        assert state[name].dtype == np.float32 and state[name].shape == want.shape, name
        np.testing.assert_allclose(state[name], want, rtol=0, atol=1e-6, err_msg=name)
    theirs = hf_model.config.to_dict()
    rope = theirs.get("rope_parameters") or {}
    for key, value in hf_config.items():
        if key == "architectures":         # transformers leaves it None for a GGUF
            assert value == [type(hf_model).__name__]
        elif key == "rope_theta":          # transformers 5 nests it
            assert value == theirs.get("rope_theta", rope.get("rope_theta")), key
        else:
            assert value == theirs.get(key), key
    assert config_from_hf(hf_config) == config_from_hf(theirs | {"architectures": None})


def test_embedded_config_and_every_tensor_match_transformers(ours, hf_embedded):
    hf_config, state = ours
    assert len(state) == 272 and hf_config["num_hidden_layers"] == 30
    _assert_same_as_transformers(hf_config, state, hf_embedded)


# ---- the tokenizer ----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tokenizers():
    from transformers import AutoTokenizer
    path = embedded_gguf_path()
    theirs = AutoTokenizer.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path))
    return tokenizer_from_gguf(path), theirs


@pytest.mark.parametrize("text", TEXTS)
def test_tokenizer_encodes_and_decodes_like_transformers(tokenizers, text):
    ours, theirs = tokenizers
    ids = ours.encode(text)
    assert ids == theirs.encode(text) and ours(text)["input_ids"] == theirs(text)["input_ids"]
    for skip in (False, True):
        assert ours.decode(ids, skip_special_tokens=skip) == theirs.decode(ids, skip_special_tokens=skip)


def test_tokenizer_specials_and_chat_template_match_transformers(tokenizers):
    ours, theirs = tokenizers
    for attr in ("bos_token", "eos_token", "unk_token", "pad_token", "bos_token_id",
                 "eos_token_id", "pad_token_id", "all_special_tokens", "all_special_ids",
                 "chat_template", "add_bos_token"):
        assert getattr(ours, attr) == getattr(theirs, attr), attr
    assert ours.eos_token_id == 2 and ours.get_vocab() == theirs.get_vocab()
    assert ours.backend_tokenizer.to_str() == theirs.backend_tokenizer.to_str()
    for tokenize in (False, True):
        got = ours.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=tokenize)
        assert got == theirs.apply_chat_template(CHAT, add_generation_prompt=True,
                                                 tokenize=tokenize)
    text = ours.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=False)
    assert text.count("<|im_start|>") == 5 and text.endswith("<|im_start|>assistant\n")


# ---- torch-free loading, end to end -----------------------------------------------------------
_BLOCKED = """
import sys, json
sys.modules["torch"] = None; sys.modules["accelerate"] = None   # any import of them fails
from jaxbatch import LLM, SamplingParams
from jaxbatch.model.loader import load_model
loaded = load_model(use_cache=False, dtype="float32")
llm = LLM(loaded=loaded, warmup=False, max_num_seqs=4, max_model_len=256)
out = llm.generate([json.loads(sys.argv[1])], SamplingParams(temperature=0, max_tokens=8,
                                                             ignore_eos=True), use_tqdm=False)
print("TOKENS", json.dumps(list(out[0].outputs[0].token_ids)))
"""


def test_embedded_model_loads_and_generates_with_torch_blocked(hf_embedded, tokenizers):
    prompt = tokenizers[1].apply_chat_template(CHAT[:1], add_generation_prompt=True)
    prompt = list(prompt["input_ids"] if hasattr(prompt, "keys") else prompt)
    ids = list(prompt)                        # the reference: HF's greedy tokens, fp32
    with torch.no_grad():
        for _ in range(8):
            ids.append(int(hf_embedded(torch.tensor([ids])).logits[0, -1].argmax()))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
         os.environ.get("PYTHONPATH", "")]))
    run = subprocess.run([sys.executable, "-c", _BLOCKED, json.dumps(prompt)], env=env,
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    line = next(ln for ln in run.stdout.splitlines() if ln.startswith("TOKENS "))
    assert json.loads(line[len("TOKENS "):]) == ids[len(prompt):]


# ---- other architectures, on tiny files written here ------------------------------------------
def _write_gguf(path, arch, *, bias=False, tied=True, vocab=64, hidden=32, heads=4, kv_heads=2,
                layers=2, ffn=48, seed=0):
    """A tiny random GGUF file with llama.cpp's keys and tensor names (F32 and F16)."""
    import gguf
    rng = np.random.default_rng(seed)
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(layers)
    w.add_context_length(128)
    w.add_embedding_length(hidden)
    w.add_feed_forward_length(ffn)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(10000.0)
    w.add_rope_dimension_count(hidden // heads)
    w.add_vocab_size(vocab)
    w.add_tokenizer_model("gpt2")
    w.add_token_list([f"t{i}" for i in range(vocab)])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    tensor = lambda *shape: rng.standard_normal(shape).astype(np.float32)   # noqa: E731
    hd = hidden // heads
    w.add_tensor("token_embd.weight", tensor(vocab, hidden).astype(np.float16))
    w.add_tensor("output_norm.weight", tensor(hidden))
    if not tied:
        w.add_tensor("output.weight", tensor(vocab, hidden))
    for i in range(layers):
        for name, shape in (("attn_q", (heads * hd, hidden)), ("attn_k", (kv_heads * hd, hidden)),
                            ("attn_v", (kv_heads * hd, hidden)), ("attn_output", (hidden, hidden)),
                            ("ffn_gate", (ffn, hidden)), ("ffn_up", (ffn, hidden)),
                            ("ffn_down", (hidden, ffn))):
            w.add_tensor(f"blk.{i}.{name}.weight", tensor(*shape))
            if bias and name in ("attn_q", "attn_k", "attn_v"):
                w.add_tensor(f"blk.{i}.{name}.bias", tensor(shape[0]))
        w.add_tensor(f"blk.{i}.attn_norm.weight", tensor(hidden))
        w.add_tensor(f"blk.{i}.ffn_norm.weight", tensor(hidden))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return str(path)


@pytest.mark.parametrize("arch,bias,tied", [("llama", False, False), ("qwen2", True, True)])
def test_tiny_files_match_transformers(tmp_path, arch, bias, tied):
    """An untied llama (output.weight, F16 embedding) and a Qwen2 (q/k/v biases, whose q/k
    rows llama.cpp does not permute) read as transformers reads them."""
    path = _write_gguf(tmp_path / f"{arch}.gguf", arch, bias=bias, tied=tied)
    hf_config, state = read_gguf_file(path)
    assert hf_config["tie_word_embeddings"] == tied
    _assert_same_as_transformers(hf_config, state, _hf_model(path))


@pytest.mark.parametrize("arch", ["gemma2", "phi3"])
def test_other_architectures_are_refused_by_name(tmp_path, arch):
    path = _write_gguf(tmp_path / f"{arch}.gguf", arch)
    with pytest.raises(ValueError, match=f"architecture '{arch}'.*supported: llama, qwen2"):
        read_gguf_file(path)
    from jaxbatch.model.loader import load_model
    with pytest.raises(ValueError, match=arch):
        load_model(path, use_cache=False)


def test_not_a_gguf_file_is_refused(tmp_path):
    for content in (b"", b"GGUF", b"not a gguf file at all, but long enough"):
        bogus = tmp_path / "bogus.gguf"
        bogus.write_bytes(content)
        with pytest.raises(ValueError, match=str(bogus)):
            gguf_reader.read_header(str(bogus))

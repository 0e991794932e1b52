"""Builds a GGUF file's tokenizer from its `tokenizer.ggml.*` metadata with the `tokenizers`
library, without torch (transformers' `AutoTokenizer.from_pretrained(..., gguf_file=...)`
imports its torch-based GGUF reader).

It rebuilds what transformers builds for the same file (tests/model/test_gguf_reader.py
compares encode, decode, special tokens and the chat template): a byte-level BPE
(`tokenizer.ggml.model == "gpt2"`: SmolLM2, Llama 3, Qwen2), the control tokens as special
added tokens, the pre-tokenizer split named by `tokenizer.ggml.pre`. Other tokenizer models
(sentencepiece "llama", as in Llama 2 / Mistral files) raise `UnsupportedTokenizer`; the
loader then falls back to transformers' builder, which needs torch.
"""
from __future__ import annotations

from jaxbatch.model.gguf_reader import read_header

_CONTROL, _USER_DEFINED = 3, 4       # llama.cpp's token types

# The regex a vocabulary's merges were learned with, by `tokenizer.ggml.pre` (llama.cpp's
# names); anything else gets GPT-2's own split, built into the ByteLevel pre-tokenizer.
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_SPLITS = {"llama3": _LLAMA3_SPLIT, "llama-v3": _LLAMA3_SPLIT, "llama-bpe": _LLAMA3_SPLIT,
           "smaug-bpe": _LLAMA3_SPLIT, "dbrx": _LLAMA3_SPLIT,
           "qwen2": _QWEN2_SPLIT, "deepseek-r1-qwen": _QWEN2_SPLIT}


class UnsupportedTokenizer(ValueError):
    pass


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table: byte-level vocabularies spell every token in
    these 256 characters."""
    printable = (list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
                 + list(range(ord("®"), ord("ÿ") + 1)))
    table, extra = {}, 0
    for b in range(256):
        if b in printable:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def tokenizer_from_gguf(path: str):
    """A `transformers.PreTrainedTokenizerFast` for the GGUF file at `path`."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    md = read_header(path).metadata
    kind = md.get("tokenizer.ggml.model")
    if kind != "gpt2":
        raise UnsupportedTokenizer(f"{path}: tokenizer.ggml.model {kind!r} is not supported "
                                   f"without torch (only 'gpt2', byte-level BPE)")
    tokens, types = md["tokenizer.ggml.tokens"], md.get("tokenizer.ggml.token_type") or []
    spelling = _bytes_to_unicode()
    alphabet = set(spelling.values())
    # A token outside the byte alphabet (a llama.cpp quirk for some added tokens) is spelled
    # in it, byte by byte, as transformers does; later duplicates win, as in a dict.
    vocab = {t if set(t) <= alphabet else "".join(spelling[b] for b in t.encode("utf-8")): i
             for i, t in enumerate(tokens)}
    merges = [tuple(m.split(" ")) for m in md.get("tokenizer.ggml.merges", [])]
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, dropout=None, unk_token=None,
                               continuing_subword_prefix="", end_of_word_suffix="",
                               fuse_unk=False, byte_fallback=False))
    split = _SPLITS.get(md.get("tokenizer.ggml.pre"))
    if split is None:
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    else:
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(split), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    # Control tokens (<|im_end|>, ...) stay whole and are skipped by decode(skip_special_tokens);
    # one spelled outside the byte alphabet is a llama.cpp mislabel and stays a plain token.
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False)
                            for t, ty in zip(tokens, types)
                            if ty == _CONTROL and set(t) <= alphabet])
    # User-defined tokens (<think>, ...) are matched whole too, but are not special.
    tok.add_tokens([AddedToken(t, special=False, normalized=False)
                    for t, ty in zip(tokens, types) if ty == _USER_DEFINED and t in vocab])

    def token(key):
        i = md.get(f"tokenizer.ggml.{key}")
        return tokens[i] if i is not None and 0 <= i < len(tokens) else None

    bos, eos = token("bos_token_id"), token("eos_token_id")
    add_bos = bool(md.get("tokenizer.ggml.add_bos_token", False)) and bos is not None
    add_eos = bool(md.get("tokenizer.ggml.add_eos_token", False)) and eos is not None
    # BOS/EOS added on encode exactly when the file says so (the template transformers writes).
    single = " ".join([f"{bos}:0"] * add_bos + ["$A:0"] + [f"{eos}:0"] * add_eos)
    pair = " ".join([single] + [f"{bos}:1"] * add_bos + ["$B:1"] + [f"{eos}:1"] * add_eos)
    specials = ([(bos, md["tokenizer.ggml.bos_token_id"])] * add_bos
                + [(eos, md["tokenizer.ggml.eos_token_id"])] * add_eos)
    tok.post_processor = processors.TemplateProcessing(single=single, pair=pair,
                                                       special_tokens=specials)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=bos, eos_token=eos, unk_token=token("unknown_token_id"),
        pad_token=token("padding_token_id"), chat_template=md.get("tokenizer.chat_template"),
        clean_up_tokenization_spaces=False)

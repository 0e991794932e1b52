"""A tiny random Qwen3 that thinks: the embedded model's tokenizer with `<think>` and
`</think>` added (plain tokens, as in Qwen3's own tokenizer), and a chat template that opens the
thought after the generation prompt (as DeepSeek-R1's and Qwen3's thinking releases do) or,
with `enable_thinking: false`, writes an empty one (as Qwen3's hybrid template does).

A random model never closes a thought by itself, so the checkpoint is made to, honestly: its
greedy answer to PROMPT is computed once (Hugging Face), and the unembedding rows of `</think>`
and of the token it would write at THOUGHT_TOKENS are swapped. The model then writes
THOUGHT_TOKENS tokens of thought and `</think>` itself, wherever its own logits put that
token first; nothing steers the engine."""
from __future__ import annotations

import os

THOUGHT_TOKENS = 4
PROMPT = [{"role": "user", "content": "Is the sky blue? Answer in JSON."}]

TEMPLATE = (
    "{%- for m in messages %}<|im_start|>{{ m.role }}\n"
    "{%- if m.role == 'assistant' and m.reasoning_content %}<think>\n{{ m.reasoning_content }}"
    "\n</think>\n\n{% endif %}{{ m.content }}<|im_end|>\n{% endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n"
    "{%- if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n"
    "{%- else %}<think>\n{% endif %}{% endif %}")


def write_thinking_model(folder: str, seed: int = 7) -> str:
    import torch
    import transformers
    from jaxbatch.model.loader import embedded_gguf_path, load_tokenizer
    tok = load_tokenizer(embedded_gguf_path())
    tok.add_tokens(["<think>", "</think>"])
    tok.chat_template = TEMPLATE
    config = transformers.Qwen3Config(
        vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
        tie_word_embeddings=False, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
    torch.manual_seed(seed)
    model = transformers.Qwen3ForCausalLM(config).eval()
    ids = tok.apply_chat_template(PROMPT, add_generation_prompt=True, return_tensors="pt",
                                  return_dict=True)["input_ids"]
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=THOUGHT_TOKENS + 1, do_sample=False,
                             eos_token_id=None)[0, ids.shape[1]:].tolist()
        first = out[THOUGHT_TOKENS]
        assert first not in out[:THOUGHT_TOKENS] + [tok.eos_token_id], out
        end = tok.convert_tokens_to_ids("</think>")
        w = model.lm_head.weight
        w[[first, end]] = w[[end, first]]
    os.makedirs(folder, exist_ok=True)
    model.save_pretrained(folder, safe_serialization=True)
    tok.save_pretrained(folder)
    return folder

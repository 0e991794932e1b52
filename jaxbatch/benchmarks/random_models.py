"""Random-weight models of real shapes in the engine's params layout, for `jaxbatch bench
roofline` and `lora`, the GPU harness (benchmarks/gpu_e2e.py) and the tests."""
from __future__ import annotations

import math
import time

import jax
import jax.numpy as jnp

from jaxbatch.model.config import ModelConfig
from jaxbatch.model.loader import LoadedModel

# Real shapes: SmolLM2-135M, Llama-3.2-1B, Llama-3.1-8B; "tiny" is for CPU dry runs and tests.
MODEL_SHAPES = {
    "tiny": ModelConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=2,
                        num_heads=4, num_kv_heads=2, head_dim=16, tie_word_embeddings=True),
    "small": ModelConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30,
                         num_heads=9, num_kv_heads=3, head_dim=64, rope_theta=100000.0,
                         tie_word_embeddings=True, max_position_embeddings=8192),
    "1B": ModelConfig(vocab_size=128256, hidden_size=2048, intermediate_size=8192,
                      num_layers=16, num_heads=32, num_kv_heads=8, head_dim=64,
                      rope_theta=500000.0, tie_word_embeddings=True, max_position_embeddings=8192),
    "8B": ModelConfig(vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                      num_layers=32, num_heads=32, num_kv_heads=8, head_dim=128,
                      rope_theta=500000.0, tie_word_embeddings=False, max_position_embeddings=8192),
}
DTYPES = {"bfloat16": jnp.bfloat16, "float32": jnp.float32}


def _layer_init(cfg: ModelConfig, dtype):
    """key -> one layer's params. Projections ~ N(0, 1/fan_in) keep the residual stream at unit
    scale through depth, so bf16 neither overflows nor flattens the logits."""
    d, f = cfg.hidden_size, cfg.intermediate_size
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    shapes = {"wq": (d, q), "wk": (d, kv), "wv": (d, kv), "wo": (q, d),
              "w_gate": (d, f), "w_up": (d, f), "w_down": (f, d)}

    def init(key):
        keys = jax.random.split(key, len(shapes))
        layer = {name: (jax.random.normal(k, shape, jnp.float32) * shape[0] ** -0.5).astype(dtype)
                 for k, (name, shape) in zip(keys, shapes.items())}
        return {**layer, "attn_norm": jnp.ones((d,), dtype), "mlp_norm": jnp.ones((d,), dtype)}
    return init


def embedding_std(cfg: ModelConfig) -> float:
    """Standard deviation of the random embeddings: untied 1, tied sqrt(2 L / d). The final
    hidden state keeps a share sqrt(std^2 / (std^2 + 2 L)) of the input token's embedding; tied
    at std 1, the input token's logit would lead by ~8 standard deviations (1B shape): the model
    would repeat its input whatever attention computes, and a kernel comparison test nothing."""
    return math.sqrt(2 * cfg.num_layers / cfg.hidden_size) if cfg.tie_word_embeddings else 1.0


def random_params(cfg: ModelConfig, dtype=jnp.bfloat16, seed: int = 0) -> dict:
    """Params in the engine's stacked layout, built one layer at a time (`lax.map`), so an 8B
    model never holds more than one layer's float32 temporaries. Embeddings ~ N(0,
    embedding_std^2), an untied lm_head ~ N(0, 1): logits spread over several units, so greedy
    choices are rarely near-ties and a kernel-vs-reference comparison tests the kernels."""
    if cfg.qkv_bias or cfg.o_bias:
        raise ValueError("random_params builds Llama-shaped models without biases")
    k_embed, k_head, k_layers = jax.random.split(jax.random.key(seed), 3)
    layers = jax.jit(lambda keys: jax.lax.map(_layer_init(cfg, dtype), keys))(
        jax.random.split(k_layers, cfg.num_layers))
    normal = jax.jit(lambda k, shape, std: (jax.random.normal(k, shape, jnp.float32)
                                            * std).astype(dtype), static_argnums=(1, 2))
    params = {"embed": normal(k_embed, (cfg.vocab_size, cfg.hidden_size), embedding_std(cfg)),
              "layers": layers, "final_norm": jnp.ones((cfg.hidden_size,), dtype)}
    if not cfg.tie_word_embeddings:
        params["lm_head"] = normal(k_head, (cfg.hidden_size, cfg.vocab_size), 1.0)
    jax.block_until_ready(params)
    return params


def random_model(name: str, dtype: str = "bfloat16", seed: int = 0,
                 config: ModelConfig | None = None) -> LoadedModel:
    """A LoadedModel without tokenizer (prompts must be token-id lists); `config` overrides the
    named shape."""
    start = time.perf_counter()
    cfg = config or MODEL_SHAPES[name]
    params = random_params(cfg, DTYPES[dtype], seed)
    return LoadedModel(cfg, params, tokenizer=None, source=f"random:{name}:{dtype}",
                       load_seconds=time.perf_counter() - start, from_cache=False)


def add_model_arguments(ap) -> None:
    """--dtype and --random-model, for benchmarks that run the embedded model or a random one."""
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--random-model", default=None,
                    help="a shape of random_models.MODEL_SHAPES instead of the embedded model")


def load_bench_model(args) -> LoadedModel:
    """The model `add_model_arguments`' flags name (a random one in bf16 under dtype "auto")."""
    if args.random_model:
        return random_model(args.random_model, "bfloat16" if args.dtype == "auto" else args.dtype)
    from jaxbatch.model.loader import load_model
    return load_model(dtype=args.dtype)

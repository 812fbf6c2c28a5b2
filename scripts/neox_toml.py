"""Hugging Face's GPTNeoXConfig for a genslm config TOML: the one mapping shared by the scripts
that build a PyTorch twin of a genslm model (bench_torch_train, hf_param_counts, check_convert).
"""
import tomllib

from transformers import GPTNeoXConfig


def model_table(path):
    """The `[model]` table of a genslm config TOML."""
    with open(path, "rb") as f:
        return tomllib.load(f)["model"]


def neox_config(m, **overrides):
    """GPT-NeoX as genslm runs it (parallel residual, tanh GELU, untied head) with `m`'s shape;
    keyword arguments replace or add GPTNeoXConfig fields."""
    fields = dict(
        vocab_size=m["vocab_size"],
        hidden_size=m["hidden_size"],
        num_hidden_layers=m["num_layers"],
        num_attention_heads=m["num_heads"],
        intermediate_size=m["intermediate_size"],
        max_position_embeddings=m["max_position_embeddings"],
        rotary_pct=m.get("rotary_pct", 0.25),
        rotary_emb_base=m.get("rotary_base", 10000.0),
        layer_norm_eps=m.get("layer_norm_eps", 1e-5),
        hidden_act="gelu_fast",
        use_parallel_residual=True,
        tie_word_embeddings=False,
        attention_bias=True,
    )
    fields.update(overrides)
    return GPTNeoXConfig(**fields)

"""GenSLM's GPT-NeoX for Hugging Face transformers, with all three of genslm's position encodings.

genslm writes its checkpoints in Hugging Face GPT-NeoX layout. Rotary models are plain GPT-NeoX;
models with learned absolute positions or ALiBi are not, and would load in `GPTNeoXForCausalLM`
with wrong logits and no warning. Such checkpoints therefore carry `model_type: "genslm_neox"`,
an `auto_map` and this file, so that

    AutoModelForCausalLM.from_pretrained(path, trust_remote_code=True)

runs them exactly as genslm does, and loading without `trust_remote_code` fails loudly.

The parameter names are GPT-NeoX's (plus `gpt_neox.embed_pos.weight`, the learned table), so the
same `model.safetensors` serves genslm and transformers. genslm's src/model/neox.rs is the
specification: parallel residual, tanh GELU, untied output embedding, no dropout.

Only full-sequence forwards are implemented (no KV cache); `generate()` works by recomputing the
whole prefix at every step.
"""

import math

import torch
from torch import nn
from torch.nn import functional as F
from transformers import GenerationMixin, PretrainedConfig, PreTrainedModel
from transformers.modeling_outputs import BaseModelOutput, CausalLMOutputWithPast

POSITIONS = ("rotary", "learned", "alibi")


class GenSlmNeoXConfig(PretrainedConfig):
    """The keys genslm writes into config.json; unknown keys are kept as attributes and ignored.

    The six shape arguments have no default: a config that lacks one is broken, and guessing a
    shape would only move the error to weight loading.
    """

    model_type = "genslm_neox"
    # transformers 4.x builds a default instance to diff against when saving; there is none.
    has_no_defaults_at_init = True

    def __init__(
        self,
        vocab_size=None,
        hidden_size=None,
        num_hidden_layers=None,
        num_attention_heads=None,
        intermediate_size=None,
        max_position_embeddings=None,
        genslm_position="rotary",
        rotary_pct=None,
        rotary_emb_base=None,
        rope_parameters=None,
        layer_norm_eps=1e-5,
        hidden_act="gelu_fast",
        use_parallel_residual=True,
        attention_bias=True,
        initializer_range=0.02,
        tie_word_embeddings=False,
        **kwargs,
    ):
        shape = dict(
            vocab_size=vocab_size,
            hidden_size=hidden_size,
            num_hidden_layers=num_hidden_layers,
            num_attention_heads=num_attention_heads,
            intermediate_size=intermediate_size,
            max_position_embeddings=max_position_embeddings,
        )
        missing = [k for k, v in shape.items() if v is None]
        if missing:
            raise ValueError(f"genslm_neox config: missing {', '.join(missing)}")
        if hidden_size % num_attention_heads:
            raise ValueError("hidden_size must be a multiple of num_attention_heads")
        if genslm_position not in POSITIONS:
            raise ValueError(f"genslm_position {genslm_position!r}: expected one of {POSITIONS}")
        # Anything genslm does not implement is refused rather than silently run differently.
        if hidden_act not in ("gelu_fast", "gelu_new", "gelu_pytorch_tanh"):
            raise ValueError(f"hidden_act {hidden_act!r}: genslm uses the tanh GELU (gelu_fast)")
        if not use_parallel_residual or not attention_bias or tie_word_embeddings:
            raise ValueError(
                "genslm models have a parallel residual, attention biases and an untied embed_out"
            )
        rope = rope_parameters or {}
        if rope.get("rope_type", "default") != "default":
            raise ValueError(f"rotary scaling {rope['rope_type']!r} is not supported")
        for k, v in shape.items():
            setattr(self, k, v)
        self.genslm_position = genslm_position
        # transformers >= 5 writes the rotary settings only under rope_parameters.
        self.rotary_pct = (
            rotary_pct if rotary_pct is not None else rope.get("partial_rotary_factor", 0.25)
        )
        self.rotary_emb_base = (
            rotary_emb_base if rotary_emb_base is not None else rope.get("rope_theta", 10000.0)
        )
        self.layer_norm_eps = layer_norm_eps
        self.hidden_act = hidden_act
        self.use_parallel_residual = use_parallel_residual
        self.attention_bias = attention_bias
        self.initializer_range = initializer_range
        super().__init__(tie_word_embeddings=tie_word_embeddings, **kwargs)
        # Set after the base class, which would otherwise standardise it as its own rotary config.
        self.rope_parameters = rope_parameters


def alibi_slopes(n):
    """genslm's `alibi_slopes` (src/model/position.rs): 2^(-8/n·(i+1)) for a power of two n; else
    the closest lower power of two p's slopes, then every other slope of 2p for the rest."""

    def pow2(n):
        start = 2.0 ** (-8.0 / n)
        return [start ** (i + 1) for i in range(n)]

    if n & (n - 1) == 0:
        return pow2(n)
    p = 1 << (n.bit_length() - 1)
    return pow2(p) + pow2(2 * p)[::2][: n - p]


def rotary_tables(rot, base, length, device):
    """cos and sin of shape [length, rot], laid out as cat(freqs, freqs) for rotate-half. Computed
    in float32 like genslm and transformers, so the angles round the same way."""
    inv_freq = 1.0 / (base ** (torch.arange(0, rot, 2, dtype=torch.float32, device=device) / rot))
    angles = torch.arange(length, dtype=torch.float32, device=device)[:, None] * inv_freq[None, :]
    emb = torch.cat((angles, angles), dim=-1)
    return emb.cos(), emb.sin()


def apply_rotary(x, cos, sin):
    """NeoX rotary on the first `rot` dims of each head of x [b, heads, s, d]; the rest pass."""
    rot = cos.shape[-1]
    x_rot, x_pass = x[..., :rot], x[..., rot:]
    x1, x2 = x_rot[..., : rot // 2], x_rot[..., rot // 2 :]
    rotated = torch.cat((-x2, x1), dim=-1)
    out = x_rot * cos + rotated * sin
    return torch.cat((out, x_pass), dim=-1)


def gelu_fast(x):
    return 0.5 * x * (1.0 + torch.tanh(0.7978845608 * x * (1.0 + 0.044715 * x * x)))


class GenSlmNeoXAttention(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.head_dim = config.hidden_size // config.num_attention_heads
        self.query_key_value = nn.Linear(config.hidden_size, 3 * config.hidden_size)
        self.dense = nn.Linear(config.hidden_size, config.hidden_size)

    def forward(self, x, bias, allowed, rope):
        b, s, h = x.shape
        # Rotary and attention in float32 whatever the weights' dtype, as genslm runs them.
        qkv = self.query_key_value(x).float()
        # GPT-NeoX's fused projection is per head [q | k | v], not three [h]-wide blocks.
        qkv = qkv.view(b, s, self.num_heads, 3 * self.head_dim).transpose(1, 2)
        q, k, v = qkv.split(self.head_dim, dim=-1)
        if rope is not None:
            q, k = apply_rotary(q, *rope), apply_rotary(k, *rope)
        scores = torch.matmul(q, k.transpose(-1, -2)) * (1.0 / math.sqrt(self.head_dim))
        if bias is not None:
            scores = scores + bias
        # A finite floor instead of -inf: a fully padded row then gets uniform weights, not NaN.
        scores = scores.masked_fill(~allowed, torch.finfo(scores.dtype).min)
        out = torch.matmul(scores.softmax(dim=-1), v)
        return self.dense(out.transpose(1, 2).reshape(b, s, h).to(x.dtype))


class GenSlmNeoXMLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.dense_h_to_4h = nn.Linear(config.hidden_size, config.intermediate_size)
        self.dense_4h_to_h = nn.Linear(config.intermediate_size, config.hidden_size)

    def forward(self, x):
        return self.dense_4h_to_h(gelu_fast(self.dense_h_to_4h(x)))


class GenSlmNeoXLayer(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.input_layernorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.post_attention_layernorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.attention = GenSlmNeoXAttention(config)
        self.mlp = GenSlmNeoXMLP(config)

    def forward(self, x, bias, allowed, rope):
        # Parallel residual: attention and MLP both read the layer's input.
        attn = self.attention(self.input_layernorm(x), bias, allowed, rope)
        return x + attn + self.mlp(self.post_attention_layernorm(x))


class GenSlmNeoXPreTrainedModel(PreTrainedModel):
    config_class = GenSlmNeoXConfig
    base_model_prefix = "gpt_neox"
    _no_split_modules = ["GenSlmNeoXLayer"]


class GenSlmNeoXModel(GenSlmNeoXPreTrainedModel):
    def __init__(self, config):
        super().__init__(config)
        self.embed_in = nn.Embedding(config.vocab_size, config.hidden_size)
        if config.genslm_position == "learned":
            self.embed_pos = nn.Embedding(config.max_position_embeddings, config.hidden_size)
        self.layers = nn.ModuleList(
            GenSlmNeoXLayer(config) for _ in range(config.num_hidden_layers)
        )
        self.final_layer_norm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.post_init()

    def get_input_embeddings(self):
        return self.embed_in

    def set_input_embeddings(self, value):
        self.embed_in = value

    def forward(self, input_ids, attention_mask=None, output_hidden_states=False, **kwargs):
        """Positions are token indices 0..s-1 in every row, as in genslm (pad on the right)."""
        c = self.config
        s = input_ids.shape[1]
        device = input_ids.device
        x = self.embed_in(input_ids)
        pos = torch.arange(s, device=device)
        if c.genslm_position == "learned":
            if s > c.max_position_embeddings:
                raise ValueError(
                    f"{s} tokens: this model has {c.max_position_embeddings} learned positions"
                )
            # Added once, to the embeddings; the layers see no position information otherwise.
            x = x + self.embed_pos(pos)[None]
        # dist[i, j] = i - j: query i may see key j when it is not in the future.
        dist = pos[:, None] - pos[None, :]
        allowed = (dist >= 0)[None, None]
        if attention_mask is not None:
            allowed = allowed & attention_mask[:, None, None, :].bool()
        bias, rope = None, None
        if c.genslm_position == "alibi":
            # Computed in float64 and rounded once, as genslm builds its bias.
            slopes = alibi_slopes(c.num_attention_heads)
            slopes = torch.tensor(slopes, dtype=torch.float64, device=device)
            bias = (-slopes[:, None, None] * dist.double()).float()[None]
        elif c.genslm_position == "rotary":
            rot = int(c.hidden_size // c.num_attention_heads * c.rotary_pct)
            if rot:
                rope = rotary_tables(rot, c.rotary_emb_base, s, device)
        # genslm's numbering: the embeddings, then each layer's output, the last one after the
        # final LayerNorm.
        hidden = [x]
        for layer in self.layers:
            x = layer(x, bias, allowed, rope)
            hidden.append(x)
        x = self.final_layer_norm(x)
        hidden[-1] = x
        return BaseModelOutput(
            last_hidden_state=x, hidden_states=tuple(hidden) if output_hidden_states else None
        )


class GenSlmNeoXForCausalLM(GenSlmNeoXPreTrainedModel, GenerationMixin):
    def __init__(self, config):
        super().__init__(config)
        self.gpt_neox = GenSlmNeoXModel(config)
        self.embed_out = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    def get_input_embeddings(self):
        return self.gpt_neox.embed_in

    def set_input_embeddings(self, value):
        self.gpt_neox.embed_in = value

    def get_output_embeddings(self):
        return self.embed_out

    def set_output_embeddings(self, value):
        self.embed_out = value

    def prepare_inputs_for_generation(self, input_ids, attention_mask=None, **kwargs):
        # No KV cache: every generation step runs the whole sequence again.
        return {"input_ids": input_ids, "attention_mask": attention_mask}

    def forward(
        self,
        input_ids=None,
        attention_mask=None,
        labels=None,
        output_hidden_states=None,
        return_dict=None,
        **kwargs,
    ):
        if kwargs.get("position_ids") is not None or kwargs.get("inputs_embeds") is not None:
            # Ignoring them would silently give other logits than the caller asked for.
            raise ValueError("genslm models take input_ids only, at positions 0..s-1 in each row")
        out = self.gpt_neox(
            input_ids,
            attention_mask=attention_mask,
            output_hidden_states=bool(output_hidden_states),
        )
        logits = self.embed_out(out.last_hidden_state)
        loss = None
        if labels is not None:
            # Position t predicts token t+1; -100 marks targets to skip (transformers' convention).
            loss = F.cross_entropy(
                logits[:, :-1].float().reshape(-1, logits.shape[-1]),
                labels[:, 1:].reshape(-1).to(logits.device),
                ignore_index=-100,
            )
        if return_dict is False:
            return tuple(t for t in (loss, logits, out.hidden_states) if t is not None)
        return CausalLMOutputWithPast(loss=loss, logits=logits, hidden_states=out.hidden_states)

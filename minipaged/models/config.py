"""A model's shape, read from a Hugging Face ``config.json``."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

LLAMA_FAMILY = ("llama", "mistral", "qwen2", "qwen3")
SUPPORTED = (*LLAMA_FAMILY, "gpt2")
ROPE_TYPES = ("default", "linear", "llama3")
LAYER_TYPES = ("full_attention", "sliding_attention")  # transformers' and vLLM's names


@dataclass
class ModelConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    max_position_embeddings: int
    norm_eps: float
    hidden_act: str = "silu"
    tie_word_embeddings: bool = False
    qkv_bias: bool = False  # bias on q, k, v (Qwen2; Llama's attention_bias)
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False  # RMSNorm on each head of q and k (Qwen3)
    rope_theta: float = 10000.0
    rope_scaling: dict = field(default_factory=dict)
    sliding_window: int | None = None  # the window of the layers that slide
    layer_types: tuple[str, ...] = ()  # per layer, "sliding_attention" or "full_attention"; () when none slides
    eos_token_ids: tuple[int, ...] = ()

    @classmethod
    def from_hf(cls, hf: dict) -> ModelConfig:
        """Read the fields minipaged needs; refuse what it cannot run, saying why."""
        model_type = hf.get("model_type")
        if model_type not in SUPPORTED:
            raise ValueError(f"model_type {model_type!r} is not supported; supported: {', '.join(SUPPORTED)}")
        eos = hf.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
        if model_type == "gpt2":
            hidden, heads = hf["n_embd"], hf["n_head"]
            return cls(
                model_type=model_type, vocab_size=hf["vocab_size"], hidden_size=hidden, num_layers=hf["n_layer"],
                num_heads=heads, num_kv_heads=heads, head_dim=hidden // heads,
                intermediate_size=hf.get("n_inner") or 4 * hidden, max_position_embeddings=hf["n_positions"],
                norm_eps=hf.get("layer_norm_epsilon", 1e-5), hidden_act=hf.get("activation_function", "gelu_new"),
                tie_word_embeddings=hf.get("tie_word_embeddings", True), qkv_bias=True, o_bias=True,
                mlp_bias=True, eos_token_ids=eos_ids,
            )
        heads = hf["num_attention_heads"]
        rope = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
        theta = rope.pop("rope_theta", hf.get("rope_theta", 10000.0))
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type not in ROPE_TYPES:
            raise ValueError(f"rope_type {rope_type!r} is not supported; supported: {', '.join(ROPE_TYPES)}")
        if hf.get("partial_rotary_factor", 1.0) != 1.0:
            raise ValueError("partial_rotary_factor other than 1.0 is not supported")
        window = hf.get("sliding_window") if hf.get("use_sliding_window", model_type == "mistral") else None
        layers = hf["num_hidden_layers"]
        if window is None:
            layer_types: tuple[str, ...] = ()
        elif model_type == "mistral":  # every layer slides (transformers' Mistral reads no layer_types)
            layer_types = ("sliding_attention",) * layers
        else:  # Qwen2/3: layer_types, else the layers from max_window_layers on
            first = hf.get("max_window_layers", 28)  # transformers' default
            layer_types = tuple(hf.get("layer_types") or ["sliding_attention" if i >= first else "full_attention"
                                                          for i in range(layers)])
        if len(layer_types) not in (0, layers) or set(layer_types) - set(LAYER_TYPES):
            raise ValueError(f"layer_types: expected {layers} of {LAYER_TYPES}, got {list(layer_types)}")
        if "sliding_attention" not in layer_types:
            window, layer_types = None, ()
        attention_bias = hf.get("attention_bias", False)
        return cls(
            model_type=model_type, vocab_size=hf["vocab_size"], hidden_size=hf["hidden_size"],
            num_layers=layers, num_heads=heads, num_kv_heads=hf.get("num_key_value_heads") or heads,
            head_dim=hf.get("head_dim") or hf["hidden_size"] // heads, intermediate_size=hf["intermediate_size"],
            max_position_embeddings=hf.get("max_position_embeddings", 2048), norm_eps=hf.get("rms_norm_eps", 1e-6),
            hidden_act=hf.get("hidden_act", "silu"),
            tie_word_embeddings=hf.get("tie_word_embeddings", False),
            qkv_bias=model_type == "qwen2" or attention_bias, o_bias=attention_bias,
            mlp_bias=hf.get("mlp_bias", False), qk_norm=model_type == "qwen3",
            rope_theta=float(theta), rope_scaling={**rope, "rope_type": rope_type},
            sliding_window=window, layer_types=layer_types, eos_token_ids=eos_ids,
        )

    def window_of(self, layer: int) -> int | None:
        """The window layer ``layer`` attends to (transformers' and vLLM's ``sliding_window``); None: all."""
        return self.sliding_window if self.layer_types and self.layer_types[layer] == "sliding_attention" else None

    def inv_freq(self) -> torch.Tensor:
        """RoPE's inverse frequencies, ``(head_dim // 2,)`` float32, with the config's scaling."""
        dim = self.head_dim
        inv = 1.0 / (self.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
        kind = self.rope_scaling.get("rope_type", "default")
        if kind == "linear":
            inv = inv / self.rope_scaling["factor"]
        elif kind == "llama3":
            factor = self.rope_scaling["factor"]
            low, high = self.rope_scaling["low_freq_factor"], self.rope_scaling["high_freq_factor"]
            old_len = self.rope_scaling.get("original_max_position_embeddings", self.max_position_embeddings)
            wavelen = 2 * math.pi / inv
            scaled = torch.where(wavelen > old_len / low, inv / factor, inv)
            smooth = (old_len / wavelen - low) / (high - low)
            smoothed = (1 - smooth) * scaled / factor + smooth * scaled
            medium = ~(wavelen < old_len / high) & ~(wavelen > old_len / low)
            inv = torch.where(medium, smoothed, scaled)
        return inv

    def kv_bytes_per_token(self, dtype: torch.dtype) -> int:
        """Bytes of K/V one token occupies, all layers together."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * torch.tensor([], dtype=dtype).element_size()

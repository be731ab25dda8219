"""Models in Hugging Face format: Llama, Mistral, Qwen2, Qwen3 and GPT-2, from a local folder.

``load_model(path)`` reads ``config.json``, builds the matching module and loads its
weights from ``model.safetensors`` or a sharded ``model.safetensors.index.json`` (with
safetensors), or else from ``pytorch_model.bin`` (or its index); ``load_tokenizer(path)``
reads ``tokenizer.json`` (with tokenizers). Nothing is downloaded: ``"tiny"`` names the
small model that ships with minipaged, anything else must be a local folder.
``minipaged.models.parallel`` has the tensor-parallel layers, and ``load_model_shard``, which
gives each rank its shard of the same checkpoints.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file
from tokenizers import Tokenizer

from minipaged.models.config import ModelConfig
from minipaged.models.transformer import AttentionMetadata, CausalLM, GroupedAttentionMetadata, build_model

TINY_MODEL_DIR = Path(__file__).parent / "tiny"
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
IGNORED_SUFFIXES = (".attn.bias", ".attn.masked_bias", "rotary_emb.inv_freq")

__all__ = ["AttentionMetadata", "CausalLM", "GroupedAttentionMetadata", "ModelConfig", "TINY_MODEL_DIR", "load_config",
           "load_model", "load_tokenizer", "load_eos_token_ids", "resolve_model_path", "resolve_dtype",
           "checkpoint_files"]


def resolve_model_path(model: str | Path) -> Path:
    """``"tiny"`` or a local folder with a ``config.json``; anything else is a clear error."""
    if str(model) == "tiny":
        return TINY_MODEL_DIR
    path = Path(model).expanduser()
    if not path.is_dir():
        raise ValueError(
            f"model {str(model)!r} is not a local folder: minipaged never downloads. Give "
            "'tiny' or the path of a Hugging Face model folder (config.json, *.safetensors, "
            "tokenizer.json), for example one made by save_pretrained or huggingface-cli download"
        )
    if not (path / "config.json").exists():
        raise ValueError(f"{path} has no config.json: not a Hugging Face model folder")
    return path


def resolve_dtype(dtype: str | torch.dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype) and dtype in DTYPES.values():
        return dtype
    if dtype in DTYPES:
        return DTYPES[dtype]
    raise ValueError(f"dtype {dtype!r} is not supported; supported: {', '.join(DTYPES)}")


WEIGHT_FILES = (("model.safetensors.index.json", "model.safetensors"),
                ("pytorch_model.bin.index.json", "pytorch_model.bin"))  # safetensors first, as transformers reads


def checkpoint_files(path: Path) -> list[Path]:
    """The weight files of a Hugging Face folder: the shards its index names, or its one file."""
    for index, single in WEIGHT_FILES:
        if (path / index).exists():
            shards = json.loads((path / index).read_text())["weight_map"].values()
            return [path / shard for shard in sorted(set(shards))]
        if (path / single).exists():
            return [path / single]
    raise ValueError(f"{path} has no model.safetensors, pytorch_model.bin nor an index of their shards")


def _state_dict(path: Path) -> dict[str, torch.Tensor]:
    state: dict[str, torch.Tensor] = {}
    for file in checkpoint_files(path):
        state.update(load_file(file) if file.suffix == ".safetensors"
                     else torch.load(file, map_location="cpu", weights_only=True))
    return state


PACKED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


def pack_fused(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Concatenate the checkpoint's q/k/v and gate/up weights (and biases) into the fused modules."""
    for fused, parts in PACKED.items():
        for key in [k for k in state if f".{parts[0]}." in k]:
            prefix, suffix = key.split(f".{parts[0]}.")  # e.g. "model.layers.0.self_attn", "weight"
            names = [f"{prefix}.{part}.{suffix}" for part in parts]
            if all(name in state for name in names):
                state[f"{prefix}.{fused}.{suffix}"] = torch.cat([state.pop(name) for name in names])
    return state


def load_config(model: str | Path) -> ModelConfig:
    """The ``ModelConfig`` of a local Hugging Face folder (``config.json``), without its weights."""
    return ModelConfig.from_hf(json.loads((resolve_model_path(model) / "config.json").read_text()))


def load_model(model: str | Path, dtype: str | torch.dtype = "float32",
               device: str | torch.device = "cpu") -> tuple[CausalLM, ModelConfig]:
    """The model of a local Hugging Face folder, in eval mode: ``(module, ModelConfig)``."""
    path = resolve_model_path(model)
    config = load_config(path)
    module = build_model(config)
    state = pack_fused({k: v for k, v in _state_dict(path).items() if not k.endswith(IGNORED_SUFFIXES)})
    if config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    prefix = "transformer." if config.model_type == "gpt2" else "model."
    if not any(k.startswith(prefix) for k in state):  # some checkpoints drop the outer prefix
        state = {(k if k.startswith("lm_head") else prefix + k): v for k, v in state.items()}
    expected = {k for k in module.state_dict() if not (config.tie_word_embeddings and k == "lm_head.weight")}
    missing, unexpected = expected - set(state), set(state) - expected
    if missing or unexpected:
        raise ValueError(f"{path}: weights do not match {config.model_type}: missing "
                         f"{sorted(missing)[:5]}, unexpected {sorted(unexpected)[:5]}")
    module.load_state_dict(state, strict=False)
    module = module.to(device=device, dtype=resolve_dtype(dtype)).eval()
    if hasattr(module, "inv_freq"):  # RoPE frequencies stay float32, as in transformers
        module.inv_freq = config.inv_freq().to(device)
    return module, config


def load_tokenizer(model: str | Path) -> Tokenizer | None:
    """The folder's ``tokenizer.json``, or None when it has none (token-id prompts only)."""
    path = resolve_model_path(model) / "tokenizer.json"
    return Tokenizer.from_file(str(path)) if path.exists() else None


def load_eos_token_ids(model: str | Path) -> frozenset[int]:
    """The tokens that end a sequence: ``config.json``'s ``eos_token_id`` and, where the folder
    has one, ``generation_config.json``'s (as transformers' ``generate`` reads them)."""
    path = resolve_model_path(model)
    ids = set(load_config(path).eos_token_ids)
    generation = path / "generation_config.json"
    eos = json.loads(generation.read_text()).get("eos_token_id") if generation.exists() else None
    ids.update(eos if isinstance(eos, list) else [] if eos is None else [eos])
    return frozenset(ids)

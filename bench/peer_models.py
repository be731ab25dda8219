"""The models that bench/throughput.py serves, and CTranslate2's copy of each.

``"tiny"`` is the 4-layer Llama that ships with minipaged. ``"qwen2.5-0.5b-shaped"`` has
Qwen2.5-0.5B's shape (24 layers, hidden 896, 14 query heads and 2 KV heads, MLP 4864, a vocabulary
of 151,936, tied embeddings, RoPE base 1e6) but random weights (``torch.manual_seed(0)``), since
nothing can be downloaded: a model whose forward pass, not the engine around it, takes the time.
It is built once, in float32, under ``build/models/``, with a small byte-level tokenizer (256
byte tokens and ``<|endoftext|>``), which the CTranslate2 converter needs for its vocabulary (it
names the other ids ``<extra_id_N>``): the prompts are random token ids, most beyond that
tokenizer, and no side needs their text.

CTranslate2 runs its own converted copy of a model (``build/ct2/<model>``, float32), made once
by its ``TransformersConverter`` from the same Hugging Face folder.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from minipaged.models import resolve_model_path

ROOT = Path(__file__).resolve().parents[1]
BUILD = ROOT / "build"

# Each model's workload: the number of requests (full run, quick run), the mean prompt and output
# lengths of the log-normal ShareGPT-like trace, and the longest request (prompt and output). The
# tiny model's are the paper's ShareGPT means scaled to its 512 positions. The 0.5B model's are much
# shorter: on one CPU thread a decoding step of it takes 0.2-0.6 s whatever the batch, and static
# batches run as many steps as their longest request, so the long tail of the lengths, cut at 48
# tokens, is what a run costs; this way a full run (4 sides, batch 16, 32 and 64, 3 repeats) takes
# about a quarter of an hour on one thread, a quick one about a minute.
WORKLOADS = {
    "tiny": {"requests": (128, 64), "mean_prompt": 161.31 * 512 / 2048, "mean_output": 337.99 * 512 / 2048,
             "max_len": 512},
    "qwen2.5-0.5b-shaped": {"requests": (32, 8), "mean_prompt": 8, "mean_output": 8, "max_len": 48},
}

# Qwen2.5-0.5B's config.json, less what only its weights or tokenizer decide.
QWEN25_05B_SHAPE = {
    "hidden_size": 896, "num_hidden_layers": 24, "num_attention_heads": 14, "num_key_value_heads": 2,
    "intermediate_size": 4864, "vocab_size": 151936, "tie_word_embeddings": True,
    "max_position_embeddings": 32768, "rope_theta": 1_000_000.0, "rms_norm_eps": 1e-6,
    "max_window_layers": 24, "use_sliding_window": False, "hidden_act": "silu",
}


def model_path(name: str) -> Path:
    """The Hugging Face folder of the named model, built first if it is the Qwen-shaped one."""
    if name == "qwen2.5-0.5b-shaped":
        path = BUILD / "models" / name
        if not (path / "config.json").exists():
            build_qwen_shaped(path)
        return path
    return resolve_model_path(name)


def byte_level_tokenizer():
    """A byte-level BPE tokenizer with no merges: one token per byte, then ``<|endoftext|>``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())  # the 256 printable stand-ins for bytes
    tokenizer = Tokenizer(models.BPE({symbol: i for i, symbol in enumerate(alphabet)}, []))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens(["<|endoftext|>"])  # id 256
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token="<|endoftext|>",
                                   eos_token="<|endoftext|>")


def build_qwen_shaped(path: Path) -> None:
    """Save a random-weight model of Qwen2.5-0.5B's shape (float32) and its tokenizer to ``path``."""
    import torch
    import transformers

    print(f"building {path.name} (random weights, float32) in {path}, once")
    tokenizer = byte_level_tokenizer()
    end = tokenizer.convert_tokens_to_ids("<|endoftext|>")
    config = transformers.Qwen2Config(**QWEN25_05B_SHAPE, bos_token_id=end, eos_token_id=end)
    torch.manual_seed(0)
    model = transformers.Qwen2ForCausalLM(config).to(torch.float32).eval()
    partial = path.with_name(path.name + ".partial")  # a run stopped half-way leaves no half a model
    shutil.rmtree(partial, ignore_errors=True)
    model.save_pretrained(partial)
    tokenizer.save_pretrained(partial)
    shutil.rmtree(path, ignore_errors=True)
    partial.rename(path)


def ctranslate2_model(name: str, hf_path: Path) -> Path:
    """CTranslate2's float32 conversion of the model at ``hf_path``, made once under ``build/ct2/``."""
    import ctranslate2

    out = BUILD / "ct2" / name
    if not (out / "model.bin").exists():
        print(f"converting {name} for CTranslate2 into {out}, once")
        partial = out.with_name(out.name + ".partial")
        shutil.rmtree(partial, ignore_errors=True)
        partial.parent.mkdir(parents=True, exist_ok=True)
        ctranslate2.converters.TransformersConverter(str(hf_path)).convert(str(partial), quantization="float32")
        shutil.rmtree(out, ignore_errors=True)
        partial.rename(out)
    return out

"""Train the small default model, ``minipaged/models/tiny``, from text every machine has.

The corpus is the docstrings of the Python standard library on this machine. The script
trains a byte-level BPE tokenizer (``tokenizers``) and a small Llama-architecture model
(``transformers``), then saves both in Hugging Face format: ``config.json``,
``model.safetensors`` (float16), ``tokenizer.json``, ``tokenizer_config.json``,
``generation_config.json``. The result is committed; run this only to rebuild it:

    .venv/bin/python scripts/train_tiny_model.py [--steps 1500] [--out minipaged/models/tiny]
"""

from __future__ import annotations

import argparse
import ast
import math
import random
import sysconfig
import time
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

SPECIAL = ["<|endoftext|>"]


def stdlib_docstrings(limit_chars: int) -> list[str]:
    """Module, class and function docstrings of the standard library, in a fixed order."""
    root = Path(sysconfig.get_paths()["stdlib"])
    docs = []
    for path in sorted(root.rglob("*.py")):
        parts = path.relative_to(root).parts
        if parts[0] == "site-packages" or any(p.startswith(("test", "idle")) for p in parts):
            continue
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError, ValueError):
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
                doc = ast.get_docstring(node)
                if doc and len(doc) > 40 and doc.isascii():
                    docs.append(" ".join(doc.split()))
    random.Random(0).shuffle(docs)
    out, total = [], 0
    for doc in docs:
        out.append(doc)
        total += len(doc)
        if total > limit_chars:
            break
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="minipaged/models/tiny")
    parser.add_argument("--steps", type=int, default=1500)
    parser.add_argument("--vocab", type=int, default=2048)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--batch", type=int, default=32)
    args = parser.parse_args()
    torch.manual_seed(0)
    torch.set_num_threads(2)
    docs = stdlib_docstrings(6_000_000)
    print(f"{len(docs)} docstrings, {sum(map(len, docs)) / 1e6:.1f} M characters")

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.train_from_iterator(docs, trainers.BpeTrainer(
        vocab_size=args.vocab, special_tokens=SPECIAL, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    eos = tokenizer.token_to_id(SPECIAL[0])
    ids = []
    for doc in docs:
        ids.extend(tokenizer.encode(doc).ids + [eos])
    data = torch.tensor(ids)
    print(f"{len(data) / 1e6:.2f} M tokens")

    config = LlamaConfig(
        vocab_size=tokenizer.get_vocab_size(), hidden_size=128, intermediate_size=384,
        num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
        max_position_embeddings=512, rope_theta=10000.0, rms_norm_eps=1e-5,
        tie_word_embeddings=True, bos_token_id=eos, eos_token_id=eos, torch_dtype="float16",
    )
    model = LlamaForCausalLM(config)
    print(f"{sum(p.numel() for p in model.parameters()) / 1e6:.2f} M parameters")
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01, betas=(0.9, 0.95))
    start = time.time()
    for step in range(args.steps):
        lr = 3e-3 * min(1.0, (step + 1) / 100) * 0.5 * (1 + math.cos(math.pi * step / args.steps))
        for group in optimizer.param_groups:
            group["lr"] = lr
        offsets = torch.randint(0, len(data) - args.seq_len - 1, (args.batch,))
        batch = torch.stack([data[o : o + args.seq_len + 1] for o in offsets.tolist()])
        loss = torch.nn.functional.cross_entropy(
            model(input_ids=batch[:, :-1]).logits.flatten(0, 1), batch[:, 1:].flatten())
        optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        if step % 100 == 0 or step == args.steps - 1:
            print(f"step {step:5d}  loss {loss.item():.3f}  {time.time() - start:.0f}s", flush=True)

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    model.to(torch.float16).save_pretrained(out, safe_serialization=True)
    tokenizer.save(str(out / "tokenizer.json"))
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token=SPECIAL[0], bos_token=SPECIAL[0]).save_pretrained(out)
    print("saved to", out)


if __name__ == "__main__":
    main()

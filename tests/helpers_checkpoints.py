"""Checkpoints the tests make themselves: seeded, randomly initialised transformers models, saved
with ``save_pretrained`` (no weights are downloaded)."""


def save_random_checkpoints(tmp_path_factory, architectures: dict) -> dict[str, str]:
    """One checkpoint per entry of ``architectures`` (name -> (transformers config class name, its
    arguments)), seeded by its position; returns name -> its folder.

    Biases start at 0 and norms at 1 in a new model: both are moved, so that loading them wrongly
    (or a wrong shard of them) shows in the outputs.
    """
    import torch
    import transformers  # here, not at the top: spawned ranks import the test modules and need no transformers

    made = {}
    for i, (name, (config_class, kwargs)) in enumerate(architectures.items()):
        torch.manual_seed(i)
        model = transformers.AutoModelForCausalLM.from_config(getattr(transformers, config_class)(**kwargs))
        with torch.no_grad():
            for param in model.parameters():
                if param.dim() == 1:
                    param.add_(0.1 * torch.randn_like(param))
        path = tmp_path_factory.mktemp(name)
        model.save_pretrained(path)
        made[name] = str(path)
    return made


def sliding_window_architectures(window: int, num_layers: int, full_layers: int,
                                 max_position_embeddings: int = 512) -> dict:
    """Two small architectures whose layers attend to a window of ``window`` tokens, for
    ``save_random_checkpoints``: "mixed" (Qwen2: its first ``full_layers`` layers attend to everything,
    the others slide) and "sliding" (Mistral: every layer slides)."""
    common = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=num_layers,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=max_position_embeddings)
    return {"mixed": ("Qwen2Config", dict(common, use_sliding_window=True, sliding_window=window,
                                          max_window_layers=full_layers)),
            "sliding": ("MistralConfig", dict(common, sliding_window=window))}


def with_transformers_models(paths: dict[str, str]) -> dict:
    """Each checkpoint's folder beside its transformers model, in float32 (name -> (folder, model))."""
    import torch
    import transformers

    return {name: (path, transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval())
            for name, path in paths.items()}


def random_prompts(seed: int, lengths, vocab_size: int = 256) -> list[list[int]]:
    """Prompts of random token ids, one of each length, from a generator seeded with ``seed``."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab_size, (n,), generator=gen).tolist() for n in lengths]


def generated_token_ids(llm, batch, params) -> list[list[int]]:
    """What ``llm`` generates for each prompt of ``batch`` (token ids), under ``params``."""
    return [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in batch], params,
                                                          use_tqdm=False)]

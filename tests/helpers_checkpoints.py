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

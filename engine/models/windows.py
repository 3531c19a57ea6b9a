"""Each layer's sliding window as transformers' attention reads it, for both ways a model runs
(the native decoder and transformers' own code): the attention module's own `sliding_window`,
else the layer's type in config.layer_types, else the config's window for every layer (Mistral,
Phi-3); 0 and None mean full attention."""
from __future__ import annotations


def layer_windows(config, attention_modules) -> list[int | None]:
    layer_types = getattr(config, "layer_types", None)
    windows = []
    for index, module in enumerate(attention_modules):
        if hasattr(module, "sliding_window"):
            window = module.sliding_window
        elif layer_types is not None:
            window = config.sliding_window if layer_types[index] == "sliding_attention" else None
        else:
            window = getattr(config, "sliding_window", None)
        windows.append(window or None)
    return windows

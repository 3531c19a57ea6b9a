"""The GPU config's serving graph measured without a GPU: `configs/serve-gpu.yaml` (the split graph:
an ingress, autoscaled engine replicas, 100 ms flushes) moved onto the CPU engine, serving a
Llama-shaped model small enough that the engine outpaces the serving path, as an engine on a GPU
does. SmolLM2's vocabulary (the workload's token ids) and two layers of 64: with 256 requests the
CPU engine makes ~3,000 output tokens a second on one thread, so what serving costs each request
and each stream message shows as it does beside a GPU. Writes OUT/model and OUT/serve.yaml:

    python benchmarks/investigations/split_graph_cpu.py OUT
    RAY_TMPDIR=$(mktemp -d) python benchmarks/serve_bench.py --launch --config OUT/serve.yaml \\
        --compare-offline --num-requests 256
"""
import argparse
import os
import sys
from pathlib import Path

import torch
import yaml

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from benchmarks.cuda_engine import SHAPES, shaped_model  # noqa: E402

SHAPE = SHAPES["smollm2-135m"] | dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2)


def cpu_config(model: str) -> dict:
    """configs/serve-gpu.yaml with the engine replica on the CPU: no GPU, one CPU, fp32 weights (quantizing
    a model this small measures nothing), HTTP on the loopback."""
    config = yaml.safe_load((ROOT / "configs" / "serve-gpu.yaml").read_text())
    config["http_options"]["host"] = "127.0.0.1"
    engine = config["applications"][0]["args"]["engine"]
    engine.update(model=model, num_gpus=0, num_cpus=1.0)
    engine["engine_args"].update(device="cpu", dtype="float32", quantization="none")
    return config


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("out", help="directory to write the model and serve.yaml into")
    out = Path(p.parse_args().out).resolve()
    model = shaped_model(os.fspath(out / "model"), SHAPE, device="cpu", dtype=torch.float32)
    (out / "serve.yaml").write_text(yaml.safe_dump(cpu_config(model), sort_keys=False))
    print(out / "serve.yaml")


if __name__ == "__main__":
    main()

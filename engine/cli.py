"""Command line: `cbserve generate --prompt "..."` for a quick try from the shell; `cbserve check`
scores the mode a start would run against fp32 (engine/quantization_check.py)."""
from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from typing import Any

from engine.config import ENGINE_FIELDS, ModelConfig
from engine.llm import LLM
from engine.sampling_params import SamplingParams


def _int_list(text: str) -> list[int]:
    """`1,2,4`: a list of ints."""
    return [int(x) for x in text.split(",")]


def _add_engine_args(parser: argparse.ArgumentParser) -> None:
    for f in ENGINE_FIELDS:
        if f.name == "seed":  # --seed is the request's sampling seed here
            continue
        flag, help = f"--{f.name.replace('_', '-')}", f.metadata["help"]
        if str(f.type) in ("bool", "bool | None"):
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, help=help)
        else:
            kinds: dict[str, Callable[[str], Any]] = {
                "int": int, "float": float, "int | None": int, "float | None": float, "list[int] | None": _int_list,
                "list[str] | None": lambda text: text.split(",")}
            kind = kinds.get(str(f.type), str)
            parser.add_argument(flag, type=kind, help=help)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="cbserve", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="generate from one or more prompts")
    gen.add_argument("--prompt", action="append", required=True, help="repeat for several prompts")
    gen.add_argument("--chat", action="store_true", help="apply the model's chat template (user turn)")
    gen.add_argument("--max-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--seed", type=int)
    gen.add_argument("--lora", help="the LoRA adapter the prompts run with (with --enable-lora and --lora-modules)")
    _add_engine_args(gen)
    check = sub.add_parser("check", help="score the model's quantized mode against fp32 on the shipped text "
                                         "(exit status 1 where it fails the bar)")
    check.add_argument("--model", help="a .gguf file or Hugging Face directory (default: the embedded model)")
    check.add_argument("--quantization", default="auto", help="the mode to score ('auto': the one a start runs)")
    check.add_argument("--kv-cache-dtype", default="auto", help="the KV cache it is scored through")
    check.add_argument("--quality-check-tokens", type=int, default=ModelConfig().quality_check_tokens,
                       help="tokens of the text scored")
    args = vars(parser.parse_args(argv))
    if args["command"] == "check":
        return _check(args)
    params = SamplingParams(max_tokens=args.pop("max_tokens"), temperature=args.pop("temperature"),
                            top_p=args.pop("top_p"), top_k=args.pop("top_k"), seed=args.pop("seed"))
    prompts, chat, lora = args.pop("prompt"), args.pop("chat"), args.pop("lora")
    args.pop("command")
    llm = LLM(**{k: v for k, v in args.items() if v is not None})
    if chat and lora is not None:
        parser.error("--lora runs with plain prompts, not --chat")
    if chat:
        outputs = llm.chat([[{"role": "user", "content": p}] for p in prompts], params)
    else:
        outputs = llm.generate(prompts, params, lora=lora)
    for prompt, output in zip(prompts, outputs):
        print(f"--- {prompt!r} ({output.outputs[0].finish_reason})\n{output.outputs[0].text}")
    return 0


def _check(args: dict) -> int:
    import logging

    from engine.model_setup import kv_cache_dtype_of, resolve_mode
    from engine.quantization_check import check

    logging.basicConfig(level=logging.INFO, format="%(message)s")
    config = ModelConfig(model=args["model"], quantization=args["quantization"],
                         quality_check_tokens=args["quality_check_tokens"])
    mode = resolve_mode(config)
    quality = check(config, mode, kv_cache_dtype_of(args["kv_cache_dtype"], mode, config))
    print(f"{config.model or 'embedded model'}: quantization {mode}: {quality}")
    return 0 if quality.passes else 1


if __name__ == "__main__":
    sys.exit(main())

"""Command line: `python -m engine.cli generate --prompt "..."` for a quick try from the shell."""
from __future__ import annotations

import argparse
import sys

from engine.config import ENGINE_FIELDS
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
            kind = {"int": int, "float": float, "int | None": int, "list[int] | None": _int_list,
                    "list[str] | None": lambda text: text.split(",")}.get(str(f.type), str)
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
    args = vars(parser.parse_args(argv))
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


if __name__ == "__main__":
    sys.exit(main())

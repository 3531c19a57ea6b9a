"""Shared fixtures: tiny random Llama-family checkpoints saved to disk with a real tokenizer, so
tests load them through the engine's own loader (no hub access anywhere); the one Ray cluster
with Serve that every real-Ray test shares."""
from __future__ import annotations

import asyncio
import contextlib
import os
import random
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

# Tiny test models gain nothing from intra-op threads, and on a shared 2-core machine OpenMP
# threads spinning against other processes make every op slower.
torch.set_num_threads(1)

ROOT = Path(__file__).parents[1]

CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
WORDS = ("the cat sat on a mat while dogs ran fast over green hills and blue lakes under bright "
         "stars as people sang songs about old ships sailing far away").split()


SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def build_tokenizer(kind: str = "bpe", special_tokens: list[str] = SPECIAL_TOKENS) -> PreTrainedTokenizerFast:
    """'bpe': a byte-level BPE (decodes any id sequence) trained on a small generated corpus, with
    `special_tokens`. 'words': one token per word of WORDS (and chat role), decoded as words joined
    by spaces, so tests can pick a generated word as a stop string and read outputs."""
    if kind == "bpe":
        rng = random.Random(0)
        corpus = [" ".join(rng.choice(WORDS) for _ in range(30)) for _ in range(300)]
        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=special_tokens,
                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
        tok.train_from_iterator(corpus, trainer)
    elif kind == "words":
        vocab = {t: i for i, t in enumerate(dict.fromkeys(
            SPECIAL_TOKENS + ["<unk>", "system", "user", "assistant"] + WORDS))}
        tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
        tok.add_special_tokens(SPECIAL_TOKENS)
        tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
        tok.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    else:
        raise ValueError(f"unknown tokenizer kind {kind!r}")
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", bos_token="<|endoftext|>",
                                   pad_token="<|endoftext|>")
    fast.chat_template = CHAT_TEMPLATE
    return fast


def _longrope(rotary_dim: int) -> dict:
    """Phi-3's LongRoPE scaling for a tiny model: short and long factors over 64 original positions."""
    half = rotary_dim // 2
    return {"rope_type": "longrope", "rope_theta": 10000.0, "original_max_position_embeddings": 64,
            "short_factor": [1.0 + 0.05 * i for i in range(half)], "long_factor": [2.0 + 0.3 * i for i in range(half)]}


# arch -> (config class, model class, config fields beyond the common sizes): one tiny checkpoint per family the
# engine runs natively, and the ones it runs through transformers' own modeling code (TRANSFORMERS_ARCHS)
TINY_ARCHS = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", dict(
        rope_parameters={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": 64, "rope_theta": 10000.0})),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(use_sliding_window=False)),
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(sliding_window=24)),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(head_dim=16)),
    "gemma": ("GemmaConfig", "GemmaForCausalLM", dict(head_dim=16)),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", dict(head_dim=16, num_hidden_layers=4, query_pre_attn_scalar=24,
                                                         sliding_window=24, attn_logit_softcapping=10.0,
                                                         final_logit_softcapping=5.0)),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", dict(
        head_dim=16, num_hidden_layers=6, query_pre_attn_scalar=24, sliding_window=24,
        layer_types=["sliding_attention", "sliding_attention", "full_attention"] * 2)),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", dict(rope_parameters=_longrope(8) | {"partial_rotary_factor": 0.5})),
    "smollm3": ("SmolLM3Config", "SmolLM3ForCausalLM", dict(no_rope_layers=[1, 0])),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", dict(num_local_experts=4, num_experts_per_tok=2)),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", dict(
        head_dim=16, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64, norm_topk_prob=True,
        num_hidden_layers=3, mlp_only_layers=[1])),
    "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM", dict(
        num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64, shared_expert_intermediate_size=96,
        norm_topk_prob=False)),
    # no native family: transformers' modeling code with the paged attention
    "gpt2": ("GPT2Config", "GPT2LMHeadModel", dict(n_embd=64, n_layer=2, n_head=4, n_positions=512)),
    "gpt_neox": ("GPTNeoXConfig", "GPTNeoXForCausalLM", dict()),
    "opt": ("OPTConfig", "OPTForCausalLM", dict(ffn_dim=128, word_embed_proj_dim=64)),
    "olmo2": ("Olmo2Config", "Olmo2ForCausalLM", dict()),
    "phi": ("PhiConfig", "PhiForCausalLM", dict()),
    "starcoder2": ("Starcoder2Config", "Starcoder2ForCausalLM", dict(sliding_window=None)),
}
NATIVE_ARCHS = ("llama", "qwen2", "mistral", "qwen3", "gemma", "gemma2", "gemma3", "phi3", "smollm3", "mixtral",
                "qwen3_moe", "qwen2_moe")
TRANSFORMERS_ARCHS = ("gpt2", "gpt_neox", "opt", "olmo2", "phi", "starcoder2")


# family -> (its chat template in tests/data/chat_templates, special tokens (EOS tokens first, the first also
# padding; the BOS token next where the template writes one), tokens added as plain text): the tokens each
# family's tokenizer holds for what its template and outputs write
CHAT_FAMILIES = {
    "qwen3": ("qwen3.jinja", ["<|im_end|>", "<|endoftext|>", "<|im_start|>"],
              ["<think>", "</think>", "<tool_call>", "</tool_call>"]),
    "llama3": ("llama3_1.jinja", ["<|eot_id|>", "<|eom_id|>", "<|begin_of_text|>", "<|start_header_id|>",
                                  "<|end_header_id|>", "<|python_tag|>"], []),
    "mistral": ("mistral_nemo.jinja", ["</s>", "<s>", "[INST]", "[/INST]", "[TOOL_CALLS]", "[AVAILABLE_TOOLS]",
                                       "[/AVAILABLE_TOOLS]", "[TOOL_RESULTS]", "[/TOOL_RESULTS]"], []),
    "gpt_oss": ("gpt_oss.jinja", ["<|return|>", "<|call|>", "<|endoftext|>", "<|start|>", "<|end|>", "<|message|>",
                                  "<|channel|>", "<|constrain|>"], []),
    "deepseek_r1": ("deepseek_r1_distill_qwen.jinja", ["<｜end▁of▁sentence｜>", "<｜begin▁of▁sentence｜>", "<｜User｜>",
                                                       "<｜Assistant｜>"], []),
}
CHAT_EOS = {"qwen3": 1, "llama3": 2, "mistral": 1, "gpt_oss": 2, "deepseek_r1": 1}  # how many EOS tokens lead
CHAT_BOS = {"llama3": "<|begin_of_text|>", "mistral": "<s>", "deepseek_r1": "<｜begin▁of▁sentence｜>"}


def build_chat_tokenizer(family: str) -> PreTrainedTokenizerFast:
    """The byte-level BPE with `family`'s tokens (CHAT_FAMILIES) and its real chat template."""
    template, special, plain = CHAT_FAMILIES[family]
    fast = build_tokenizer("bpe", special)
    fast.add_tokens(plain)
    fast.eos_token, fast.pad_token = special[0], special[0]
    fast.bos_token = CHAT_BOS.get(family)
    fast.chat_template = (ROOT / "tests" / "data" / "chat_templates" / template).read_text()
    return fast


def save_tiny_chat_model(path, family: str, arch: str = "qwen3") -> str:
    """A tiny random `arch` checkpoint with `family`'s tokenizer and chat template (its EOS tokens
    the model's), for reasoning and tool calls as that family writes them."""
    tokenizer = build_chat_tokenizer(family)
    special = CHAT_FAMILIES[family][1]
    eos = [tokenizer.convert_tokens_to_ids(t) for t in special[:CHAT_EOS[family]]]
    return save_tiny_model(path, arch, tokenizer=tokenizer, eos_token_id=eos if len(eos) > 1 else eos[0],
                           max_position_embeddings=4096)


def save_tiny_model(path, arch: str = "llama", seed: int = 0, tokenizer: str | PreTrainedTokenizerFast = "bpe",
                    **sizes) -> str:
    """A tiny random checkpoint of `arch` (TINY_ARCHS) saved with its tokenizer (a kind of
    build_tokenizer's, or one built); `sizes`: config fields to override (hidden_size,
    num_hidden_layers, ...)."""
    import transformers

    tokenizer = build_tokenizer(tokenizer) if isinstance(tokenizer, str) else tokenizer
    config_name, model_name, fields = TINY_ARCHS[arch]
    common = dict(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                  initializer_range=0.3, eos_token_id=tokenizer.eos_token_id, bos_token_id=tokenizer.bos_token_id,
                  pad_token_id=tokenizer.pad_token_id, tie_word_embeddings=False) | fields | sizes
    config_class = getattr(transformers, config_name)
    if "num_key_value_heads" not in config_class.__annotations__:  # multi-head only (GPT-2, OPT, ...)
        common.pop("num_key_value_heads")
    torch.manual_seed(seed)
    model = getattr(transformers, model_name)(config_class(**common))
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory) -> str:
    return save_tiny_model(tmp_path_factory.mktemp("tiny-llama"), "llama")


@pytest.fixture(scope="session")
def tiny_qwen2(tmp_path_factory) -> str:
    return save_tiny_model(tmp_path_factory.mktemp("tiny-qwen2"), "qwen2")


@pytest.fixture(scope="session")
def tiny_llama_words(tmp_path_factory) -> str:
    return save_tiny_model(tmp_path_factory.mktemp("tiny-llama-words"), "llama", tokenizer="words")


HEADER_TIMEOUT_S = 2.0  # serve_app.front_door's header deadline in the test cluster's proxy
KEEP_ALIVE_TIMEOUT_S = 3  # http_options.keep_alive_timeout_s of the test cluster


def seconds_until_closed(s: socket.socket, limit_s: float) -> float:
    """Reads until the server closes the connection; seconds it took."""
    t0 = time.monotonic()
    s.settimeout(limit_s)
    while s.recv(65536):
        pass
    return time.monotonic() - t0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def free_port_block(n: int, lo: int = 30000, hi: int = 32000) -> int:
    """The first port of `n` consecutive free loopback ports in [lo, hi), below Linux's ephemeral
    range (Ray's default for direct-ingress ports is 30000-31000)."""
    for base in range(lo, hi - n + 1, n):
        try:
            with contextlib.ExitStack() as stack:
                for port in range(base, base + n):
                    stack.enter_context(socket.socket()).bind(("127.0.0.1", port))
            return base
        except OSError:
            continue
    raise RuntimeError(f"no {n} consecutive free ports in [{lo}, {hi})")


@contextlib.contextmanager
def serving(app) -> Iterator[tuple[str, asyncio.AbstractEventLoop]]:
    """(url, loop): the ASGI `app` behind a real HTTP server (uvicorn on a free loopback port, on
    its own thread and event loop), for clients that need real connections."""
    import uvicorn

    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=free_port(), log_level="warning"))
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_until_complete, args=(server.serve(),), daemon=True)
    thread.start()
    for _ in range(3000):
        if server.started:
            break
        time.sleep(0.01)
    try:
        assert server.started, "uvicorn did not start"
        yield f"http://127.0.0.1:{server.config.port}", loop
    finally:
        server.should_exit = True
        thread.join(30)


def run_app(app_config, name: str, engine_cls=None) -> str:
    """`serve.run` of build_app(app_config) as app `name` behind the front door `make serve` gives it
    (serve_app/launch.py): its ingress replicas serve a port of their own (`ingress.shared_port`),
    with the test cluster's keep-alive timeout. Its URL there; Serve's proxy serves it at /name."""
    from ray import serve

    from serve_app.app import build_app
    from serve_app.config import SharedPortConfig

    port = SharedPortConfig(host="127.0.0.1", port=free_port(), keep_alive_timeout_s=KEEP_ALIVE_TIMEOUT_S)
    ingress = app_config.ingress.model_copy(update={"shared_port": port})
    serve.run(build_app(app_config.model_copy(update={"ingress": ingress}), engine_cls), name=name,
              route_prefix=f"/{name}")
    return f"http://127.0.0.1:{port.port}"


@pytest.fixture(scope="session")
def serve_cluster(tmp_path_factory):
    """Head node + Serve, shared by every real-Ray test: a process connects to one cluster at a
    time and each costs seconds and GBs, so tests needing more nodes add them to this one
    (`cluster.add_node`) and remove them before they end. Apps run by `run_app` take HTTP
    connections as `make serve`'s do, on a port of their own; Serve's proxy answers on `http` too.
    Serve's pace and event loops are `make serve`'s too."""
    # Serve reads SERVE_LOOP_ENV when imported, the cluster's workers when they start: imported first,
    # this process's own handles keep Serve's router thread (tests call them from threads with no loop).
    import ray.serve  # noqa: F401

    from serve_app.launch import HEADER_DEADLINE_ENV, serve_env

    tmp = tmp_path_factory.mktemp("ray")
    env = HEADER_DEADLINE_ENV | serve_env() | {
        "RAY_TMPDIR": str(tmp), "RAY_AUTH_MODE": "disabled",
        "RAY_metrics_report_interval_ms": "1000", "RAY_SERVE_LOG_TO_STDERR": "0",
        "CBSERVE_HEADER_TIMEOUT_S": str(HEADER_TIMEOUT_S),
        "PYTHONPATH": os.pathsep.join(
            [str(ROOT), str(ROOT / "tests" / "serve"), os.environ.get("PYTHONPATH", "")]),
    }
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    import ray
    from ray import serve
    from ray.cluster_utils import Cluster

    metrics_port = free_port()
    (tmp / "ray").mkdir()  # Cluster writes its address to $RAY_TMPDIR/ray/ray_current_cluster
    # The dashboard process writes the Prometheus service-discovery file the metrics tests scrape by.
    cluster = Cluster(initialize_head=True, head_node_args=dict(
        num_cpus=4, num_gpus=torch.cuda.device_count(), include_dashboard=True, dashboard_port=free_port(),
        temp_dir=str(tmp), metrics_export_port=metrics_port))
    ray.init(address=cluster.address, log_to_driver=False)
    http_port = free_port()
    serve.start(proxy_location="HeadOnly", http_options={
        "host": "127.0.0.1", "port": http_port, "keep_alive_timeout_s": KEEP_ALIVE_TIMEOUT_S})
    try:
        yield {"http": f"http://127.0.0.1:{http_port}",
               "cluster": cluster, "ray_tmpdir": tmp}
    finally:
        serve.shutdown()
        ray.shutdown()
        cluster.shutdown()
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v

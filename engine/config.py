"""Engine configuration: one frozen dataclass per part, validated on construction.

Owns the knobs, their one-line help and their validation; does not load weights or read YAML.
`EngineConfig.from_kwargs` takes every field of every part by name, as vLLM's EngineArgs do; the
CLI's flags and the serve config's `engine_args` are generated from these fields (ENGINE_FIELDS),
so neither can drift from the engine. Torch-free.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from engine.errors import AdapterNotFoundError, InvalidRequestError

POLICIES = ("fcfs", "sjf", "priority", "static")
PREEMPTION_MODES = ("recompute", "swap", "auto")
DTYPES = ("auto", "float32", "bfloat16", "float16")
KV_CACHE_DTYPES = ("auto", "float32", "float16")
QUANTIZATION_MODES = ("none", "int8", "gguf", "w8a16", "w4a16", "auto")
SPECULATIVE_METHODS = ("ngram", "self_draft", "draft_model")
DRAFT_PLACEMENTS = ("local", "actor")
DEFAULT_KV_CACHE_BYTES = 1 << 30
ATTENTION_BACKENDS = ("auto", "torch", "cpu", "flash", "triton")
MODEL_IMPLS = ("auto", "native", "transformers")
VICTIM_ORDERS = ("lowest_priority_latest_arrival", "latest_arrival")
REASONING_PARSERS = ("auto", "think", "harmony", "none")
TOOL_CALL_PARSERS = ("auto", "hermes", "llama3_json", "mistral", "harmony")
POOLINGS = ("last", "mean")


def _opt(default, help: str):
    return field(default=default, metadata={"help": help})


@dataclass(frozen=True, slots=True)
class ModelConfig:
    model: str | None = _opt(None, "HF directory or .gguf file; None: the embedded SmolLM2-135M-Instruct")
    device: str = _opt("cpu", "'cpu' or 'cuda'")
    attention_backend: str = _opt("auto", "'auto', 'torch', 'cpu' (C++ decode kernel), 'flash' (CUDA: torch's "
                                          "FlashAttention over gathered contexts) or 'triton' (CUDA: a Triton kernel "
                                          "over the paged cache in place)")
    enforce_eager: bool = _opt(False, "CUDA: run every step eagerly; off: decode-only steps replay CUDA graphs "
                                      "(attention_backend 'triton')")
    cuda_graph_sizes: list[int] | None = _opt(None, "CUDA: decode batch sizes (rows) captured as graphs; a step "
                                                    "pads to the next one; None: 1, 2, 4, then every 8 up to "
                                                    "max_num_seqs (at most 512)")
    cuda_graph_memory_bytes: int = _opt(1 << 30, "CUDA: the most memory the graphs may take; larger sizes past "
                                                 "it run eagerly")
    max_model_len: int | None = _opt(None, "longest prompt + output; None: the model's max_position_embeddings")
    seed: int = _opt(0, "seeds requests that carry no seed of their own")
    num_threads: int | None = _opt(None, "torch intra-op threads for this process; None keeps torch's")
    dtype: str = _opt("auto", "weights, activations and KV cache: 'auto' (bfloat16 on CUDA, float32 on CPU), "
                              "'float32', 'bfloat16' or 'float16'")
    quantization: str = _opt("auto", "matmul weights: 'auto' (by rule, nothing timed or scored at start: a .gguf "
                                     "file's own blocks ('gguf'); a Hugging Face checkpoint stored in 16 bits "
                                     "'int8' where the C++ kernels load, one stored in fp32 'none'; 'none' on CUDA "
                                     "or with 16-bit activations), "
                                     "'none' (fp32, exact), 'int8' (GGUF Q8_0 blocks, a quarter of "
                                     "fp32's bytes per decode step, activations rounded to bf16), 'gguf' (a .gguf "
                                     "model's own blocks mapped from the file, Q4_0/Q4_1/Q5_0/Q5_1/Q8_0/Q4_K/Q5_K/"
                                     "Q6_K/IQ4_XS in any mix, other types as 'int8'; activations quantized per block "
                                     "of 32) or 'w8a16'/'w4a16' (int8/int4 weights, bf16 activations)")
    model_impl: str = _opt("auto", "how the model runs: 'auto' (its native family where engine/models/families.py "
                                   "has one, else transformers' own modeling code with the paged attention), "
                                   "'native' (refused for an architecture without a family) or 'transformers'")
    reasoning_parser: str = _opt("auto", "how chat outputs' reasoning is told from the answer: 'auto' (from the chat "
                                         "template: 'harmony' where it writes gpt-oss's channels, 'think' where it "
                                         "writes </think>, else 'none'), 'think' (<think>...</think>), 'harmony' or "
                                         "'none'")
    tool_call_parser: str = _opt("auto", "the format tool calls are forced in and read from: 'auto' (from the chat "
                                         "template's markers, else 'hermes'), 'hermes', 'llama3_json', 'mistral' or "
                                         "'harmony'")
    pooling: str = _opt("last", "embeddings: the final hidden states of a prompt's last token ('last') or their mean "
                                "over its tokens ('mean'), L2-normalised")
    quality_check_tokens: int = _opt(6000, "tokens of the shipped English text `cbserve check` scores a quantized "
                                           "mode on against fp32 (never at start; an engine reports the figures a "
                                           "check left for its model and mode)")

    def __post_init__(self):
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        if self.quantization not in QUANTIZATION_MODES:
            raise ValueError(f"quantization must be one of {QUANTIZATION_MODES}, got {self.quantization!r}")
        if self.quantization not in ("none", "auto") and self.device != "cpu":
            raise ValueError(f"quantization {self.quantization!r} runs on the CPU (its kernel is C++ for x86); "
                             "use 'none' on CUDA")
        if self.quantization not in ("none", "auto") and self.resolved_dtype != "float32":
            raise ValueError(f"quantization {self.quantization!r} computes in float32, got dtype {self.dtype!r}")
        if self.quantization == "gguf" and self.model is not None and not self.model.endswith(".gguf"):
            raise ValueError(f"quantization 'gguf' runs a .gguf file's own blocks, got model {self.model!r}; "
                             "use 'int8' to quantize other checkpoints")
        if self.quality_check_tokens < 0:
            raise ValueError(f"quality_check_tokens must be >= 0, got {self.quality_check_tokens}")
        for name, allowed in (("reasoning_parser", REASONING_PARSERS), ("tool_call_parser", TOOL_CALL_PARSERS),
                              ("pooling", POOLINGS)):
            if getattr(self, name) not in allowed:
                raise ValueError(f"{name} must be one of {allowed}, got {getattr(self, name)!r}")
        if self.model_impl not in MODEL_IMPLS:
            raise ValueError(f"model_impl must be one of {MODEL_IMPLS}, got {self.model_impl!r}")
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(f"attention_backend must be one of {ATTENTION_BACKENDS}, got {self.attention_backend!r}")
        if self.cuda_graph_sizes is not None and (not self.cuda_graph_sizes or min(self.cuda_graph_sizes) < 1):
            raise ValueError(f"cuda_graph_sizes must be batch sizes >= 1, got {self.cuda_graph_sizes}")
        if self.cuda_graph_memory_bytes < 0:
            raise ValueError(f"cuda_graph_memory_bytes must be >= 0, got {self.cuda_graph_memory_bytes}")
        if self.num_threads is not None and self.num_threads < 1:
            raise ValueError(f"num_threads must be >= 1, got {self.num_threads}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2, got {self.max_model_len}")

    @property
    def resolved_dtype(self) -> str:
        """`auto` made concrete: bfloat16 where the device has fast bf16 matmuls (CUDA), float32 on
        CPU (the exact reference; bf16 GEMM is slow on CPUs without AMX)."""
        if self.dtype != "auto":
            return self.dtype
        return "float32" if self.device == "cpu" else "bfloat16"


@dataclass(frozen=True, slots=True)
class CacheConfig:
    block_size: int = _opt(16, "tokens per KV block")
    num_blocks: int | None = _opt(None, "KV blocks on the device; overrides kv_cache_memory_bytes when set")
    kv_cache_memory_bytes: int | None = _opt(None, "KV pool size in bytes; None: on the CPU cpu_memory_utilization "
                                                    "of the memory left after the weights where set, else 1 GiB; "
                                                    "on CUDA what gpu_memory_utilization leaves after the weights, a "
                                                    "profiled peak step and the CUDA graphs")
    cpu_memory_utilization: float | None = _opt(None, "CPU: the fraction of the host memory available once the "
                                                      "weights are loaded that the KV pool takes (its pages are "
                                                      "the OS's until blocks are written); None: 1 GiB")
    gpu_memory_utilization: float = _opt(0.9, "CUDA: the fraction of the GPU's memory this engine may take (weights, "
                                              "activations, graphs and the KV pool)")
    swap_space_bytes: int = _opt(1 << 30, "host pool for swap preemption, bytes")
    enable_prefix_caching: bool = _opt(True, "reuse cached full blocks of shared prefixes")
    kv_cache_dtype: str = _opt("auto", "'auto' (fp16 under the quantized mode quantization 'auto' picks, "
                                       "else the model's dtype), 'float32' or 'float16': half the bytes "
                                       "decode attention reads and twice the blocks in the same memory, the "
                                       "keys and values rounded to fp16 (CPU; on CUDA the cache keeps the "
                                       "model's dtype)")

    def __post_init__(self):
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {self.kv_cache_dtype!r}")
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}")
        if self.num_blocks is not None and self.num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {self.num_blocks}")
        if self.kv_cache_memory_bytes is not None and self.kv_cache_memory_bytes <= 0:
            raise ValueError(f"kv_cache_memory_bytes must be > 0, got {self.kv_cache_memory_bytes}")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.cpu_memory_utilization is not None and not 0 < self.cpu_memory_utilization <= 1:
            raise ValueError(f"cpu_memory_utilization must be in (0, 1], got {self.cpu_memory_utilization}")
        if self.swap_space_bytes < 0:
            raise ValueError(f"swap_space_bytes must be >= 0, got {self.swap_space_bytes}")

    @property
    def kv_cache_bytes(self) -> int:
        """The pool's size where it is not measured from the GPU: kv_cache_memory_bytes, or 1 GiB."""
        return self.kv_cache_memory_bytes or DEFAULT_KV_CACHE_BYTES


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    policy: str = _opt("fcfs", "'fcfs', 'sjf', 'priority' (lower first; may preempt lower classes), 'static'")
    max_num_seqs: int = _opt(64, "requests in one step's batch")
    max_num_batched_tokens: int = _opt(512, "token budget of one step (decodes first, prefill chunks fill the rest)")
    enable_chunked_prefill: bool = _opt(True, "split long prompts across steps")
    aging_rate: float = _opt(1.0, "rank gained per second of waiting (sjf: tokens/s, priority: classes/s)")
    preemption_mode: str = _opt("recompute", "'recompute', 'swap', or 'auto' (cheaper of moving KV vs recomputing)")
    victim_order: str = _opt("lowest_priority_latest_arrival", "who is preempted first (not under 'priority')")
    target_step_latency_s: float | None = _opt(None, "size each step to this wall time (a step-time model "
                                                     "measured online): decodes keep their time per token "
                                                     "under it, prefill chunks take the rest; None: "
                                                     "max_num_batched_tokens every step")
    embedding_step_share: float = _opt(0.2, "while requests decode, embedding prompts take at most this fraction "
                                            "more of a step's time than the decodes alone (the step-time model's "
                                            "figures), so generation's time per token stays within 1 + this of "
                                            "what it is without them; with nothing decoding they take the budget")
    async_scheduling: bool | None = _opt(None, "a steady batch of decodes schedules and queues its next step "
                                               "before this step's tokens reach the host, so the host's work "
                                               "between steps overlaps the device's (vLLM's async scheduling); "
                                               "None: on with device 'cuda', where the device runs apart from "
                                               "the host")

    def __post_init__(self):
        if self.policy not in POLICIES:
            raise ValueError(f"policy must be one of {POLICIES}, got {self.policy!r}")
        if self.preemption_mode not in PREEMPTION_MODES:
            raise ValueError(f"preemption_mode must be one of {PREEMPTION_MODES}, got {self.preemption_mode!r}")
        if self.victim_order not in VICTIM_ORDERS:
            raise ValueError(f"victim_order must be one of {VICTIM_ORDERS}, got {self.victim_order!r}")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}")
        if self.aging_rate < 0:
            raise ValueError(f"aging_rate must be >= 0, got {self.aging_rate}")
        if self.target_step_latency_s is not None and not self.target_step_latency_s > 0:
            raise ValueError(f"target_step_latency_s must be > 0, got {self.target_step_latency_s}")
        if not self.embedding_step_share > 0:
            raise ValueError(f"embedding_step_share must be > 0, got {self.embedding_step_share}")


@dataclass(frozen=True, slots=True)
class SpeculativeConfig:
    """Speculative decoding, spelt as vLLM's `speculative_config` (a dict in engine arguments)."""
    method: str = _opt("ngram", "'ngram' (prompt lookup: drafts copied from the request's own earlier tokens), "
                                "'self_draft' (the target's first num_layers layers, norm and LM head) or "
                                "'draft_model' (a smaller model with the target's vocabulary: `model`)")
    num_speculative_tokens: int = _opt(4, "most draft tokens verified per request and step")
    prompt_lookup_min: int = _opt(1, "ngram: shortest suffix looked up")
    prompt_lookup_max: int = _opt(4, "ngram: longest suffix looked up")
    num_layers: int | None = _opt(None, "self_draft: how many of the target's first layers draft "
                                        "(default: a quarter of them)")
    model: str | None = _opt(None, "draft_model: HF directory or .gguf file of the draft model")
    quantization: str | None = _opt(None, "draft_model: the draft's matmuls, a ModelConfig quantization mode "
                                          "(default 'none'; e.g. the target's own .gguf as a 'gguf' draft of an "
                                          "fp32 target); self_draft runs the target's own")
    placement: str = _opt("local", "draft_model/self_draft: 'local' (in the engine process) or 'actor' (a "
                                   "draft worker elsewhere, one batched call per step through the transport "
                                   "the host hands the engine: the serve app's DraftModel deployment)")
    deadline_s: float = _opt(0.25, "actor: a proposal later than this means plain decoding for the step")
    adaptive: bool = _opt(True, "verify only the drafts expected to pay: k per request from its acceptance "
                                "history and the measured step cost (0 in a full batch); off: every draft")

    def __post_init__(self):
        if self.method not in SPECULATIVE_METHODS:
            raise ValueError(f"speculative method must be one of {SPECULATIVE_METHODS}, got {self.method!r}")
        if self.num_speculative_tokens < 1:
            raise ValueError(f"num_speculative_tokens must be >= 1, got {self.num_speculative_tokens}")
        if (self.method == "draft_model") != (self.model is not None):
            raise ValueError("speculative `model` (the draft model) is required with method 'draft_model' "
                             "and only there")
        if self.quantization is not None and (self.method != "draft_model" or self.quantization == "auto"
                                              or self.quantization not in QUANTIZATION_MODES):
            raise ValueError(f"speculative `quantization` sets a draft_model's mode: one of "
                             f"{[m for m in QUANTIZATION_MODES if m != 'auto']}, got {self.quantization!r} "
                             f"with method {self.method!r}")
        if self.placement not in DRAFT_PLACEMENTS:
            raise ValueError(f"placement must be one of {DRAFT_PLACEMENTS}, got {self.placement!r}")
        if self.placement == "actor" and not self.uses_draft_model:
            raise ValueError("placement 'actor' runs a draft model: method 'draft_model' or 'self_draft'")
        if not self.deadline_s > 0:
            raise ValueError(f"deadline_s must be > 0, got {self.deadline_s}")
        if self.num_layers is not None and self.num_layers < 1:
            raise ValueError(f"num_layers must be >= 1, got {self.num_layers}")
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise ValueError(f"need 1 <= prompt_lookup_min <= prompt_lookup_max, got "
                             f"{self.prompt_lookup_min}, {self.prompt_lookup_max}")

    @property
    def uses_draft_model(self) -> bool:
        """Drafts come from a model (draft_model, or the target's first layers), not from lookup."""
        return self.method != "ngram"

    @classmethod
    def of(cls, value: SpeculativeConfig | dict | None) -> SpeculativeConfig | None:
        if value is None or isinstance(value, cls):
            return value
        if not isinstance(value, dict):
            raise ValueError(f"speculative_config must be a dict, got {type(value).__name__}")
        unknown = set(value) - {f.name for f in dataclasses.fields(cls)}
        if unknown:
            raise ValueError(f"unknown speculative_config keys: {sorted(unknown)}")
        return cls(**value)


@dataclass(frozen=True, slots=True)
class LoraConfig:
    """LoRA adapters over the served model, as vLLM's `--enable-lora` arguments spell them."""
    enable_lora: bool = _opt(False, "serve PEFT LoRA adapters over the model (native families): named in "
                                    "lora_modules, found under adapter_dirs, or loaded at run time")
    lora_modules: list[str] | None = _opt(None, "adapters known at start, each 'name=path' (a PEFT adapter "
                                                "directory: adapter_config.json + adapter_model.safetensors)")
    adapter_dirs: list[str] | None = _opt(None, "where a request's adapter name is looked up when not known: "
                                                "directories or fsspec URLs (file://, s3://, gs://, ... where the "
                                                "package for it is installed) holding one adapter directory per name")
    max_loras: int = _opt(8, "most distinct adapters in one step's batch (requests of others wait their turn)")
    max_cpu_loras: int = _opt(16, "most adapters held loaded; the least recently used one no request runs is "
                                  "evicted for a new one")
    max_lora_rank: int = _opt(64, "highest adapter rank accepted")
    lora_dtype: str = _opt("auto", "adapters' A and B: 'float32', 'bfloat16' (half the bytes a decode step reads "
                                   "for them), or 'auto' (float32 under quantization 'none', bfloat16 under the "
                                   "quantized modes, whose base is no closer to fp32)")

    def __post_init__(self):
        if self.max_loras < 1 or self.max_cpu_loras < self.max_loras:
            raise ValueError(f"need 1 <= max_loras <= max_cpu_loras, got {self.max_loras}, {self.max_cpu_loras}")
        if not 1 <= self.max_lora_rank <= 256:
            raise ValueError(f"max_lora_rank must be in [1, 256], got {self.max_lora_rank}")
        for module in self.lora_modules or ():
            name, _, path = module.partition("=")
            if not name or not path or ":" in name:
                raise ValueError(f"lora_modules entries are 'name=path' (a name without ':'), got {module!r}")
        if self.lora_dtype not in ("auto", "float32", "bfloat16"):
            raise ValueError(f"lora_dtype must be 'auto', 'float32' or 'bfloat16', got {self.lora_dtype!r}")
        if (self.lora_modules or self.adapter_dirs) and not self.enable_lora:
            raise ValueError("lora_modules and adapter_dirs need enable_lora")

    @property
    def modules(self) -> dict[str, str]:
        return dict(module.split("=", 1) for module in self.lora_modules or ())

    def with_adapter(self, name: str, path: str) -> LoraConfig:
        """This config serving adapter `name` from `path` too (/v1/load_lora_adapter's rule; the
        same name and path again changes nothing). InvalidRequestError where LoRA is off, the name
        is not one or is taken, or a local path holds no adapter."""
        if not self.enable_lora:
            raise InvalidRequestError("lora_name", "LoRA adapters are not enabled (enable_lora)")
        if not name or ":" in name or "=" in name:
            raise InvalidRequestError("lora_name", f"adapter names are non-empty, without ':' or '=', got {name!r}")
        modules = self.modules
        if modules.get(name, path) != path:
            raise InvalidRequestError("lora_name", f"adapter {name!r} is already loaded from {modules[name]}; "
                                                   "unload it first")
        if "://" not in path and not (Path(path) / "adapter_config.json").is_file():
            raise InvalidRequestError("lora_path", f"no adapter_config.json under {path!r}")
        return self._with_modules({**modules, name: path})

    def without_adapter(self, name: str) -> LoraConfig:
        """This config no longer serving adapter `name` (AdapterNotFoundError where it does not)."""
        modules = self.modules
        if modules.pop(name, None) is None:
            raise AdapterNotFoundError("lora_name", f"adapter {name!r} is not loaded", "model_not_found")
        return self._with_modules(modules)

    def _with_modules(self, modules: dict[str, str]) -> LoraConfig:
        return dataclasses.replace(self, lora_modules=[f"{k}={v}" for k, v in modules.items()] or None)


@dataclass(frozen=True, slots=True)
class EngineConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    lora: LoraConfig = field(default_factory=LoraConfig)
    speculative: SpeculativeConfig | None = None  # None: plain decoding

    @classmethod
    def from_kwargs(cls, **kwargs) -> EngineConfig:
        """Builds the config from flat field names (`max_num_seqs=8, block_size=16, ...`) and
        `speculative_config` (a dict of SpeculativeConfig's fields)."""
        parts: dict[str, Any] = {"speculative": SpeculativeConfig.of(kwargs.pop("speculative_config", None))}
        for name, part_cls in zip(("model", "cache", "scheduler", "lora"), ENGINE_PARTS):
            names = {f.name for f in dataclasses.fields(part_cls)}
            parts[name] = part_cls(**{k: kwargs.pop(k) for k in list(kwargs) if k in names})
        if kwargs:
            raise ValueError(f"unknown engine arguments: {sorted(kwargs)}")
        return cls(**parts)


ENGINE_PARTS = (ModelConfig, CacheConfig, SchedulerConfig, LoraConfig)
ENGINE_FIELDS = tuple(f for part in ENGINE_PARTS for f in dataclasses.fields(part))  # every engine argument

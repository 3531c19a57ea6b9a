"""cbserve engine: continuous batching over a paged KV cache."""
from engine.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from engine.llm import LLM
from engine.llm_engine import LLMEngine
from engine.outputs import CompletionOutput, RequestMetrics, RequestOutput
from engine.sampling_params import SamplingParams

__all__ = ["LLM", "LLMEngine", "SamplingParams", "EngineConfig", "ModelConfig", "CacheConfig", "SchedulerConfig",
           "RequestOutput", "CompletionOutput", "RequestMetrics"]

"""cbserve engine: continuous batching over a paged KV cache."""
from engine.async_engine import AsyncEngine
from engine.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from engine.llm import LLM
from engine.llm_engine import LLMEngine
from engine.metrics import EngineStats
from engine.outputs import CompletionOutput, RequestMetrics, RequestOutput
from engine.sampling_params import SamplingParams

__all__ = ["LLM", "LLMEngine", "AsyncEngine", "SamplingParams", "EngineConfig", "ModelConfig", "CacheConfig",
           "SchedulerConfig", "EngineStats", "RequestOutput", "CompletionOutput", "RequestMetrics"]

"""Factories for engine tests: scheduler without a model, one step with fake sampled tokens, a
fake clock, an engine stepped to the end (its deltas held between flushes, as the engine process
holds them), HF reference generation, prompts that repeat themselves, a draft checkpoint, a ragged
batch for an attention backend with the attention it must give, the fused kernels' check."""
from __future__ import annotations

import itertools
import random
from dataclasses import dataclass

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from engine.attention.base import AttentionParams
from engine.batch import ModelInputs
from engine.config import SchedulerConfig, SpeculativeConfig
from engine.kv_cache.manager import KVCacheManager
from engine.outputs import ModelRunnerOutput, RequestError, RequestOutput
from engine.request import Request
from engine.sampling_params import SamplingParams
from engine.scheduler.output import ScheduledRequest, SchedulerOutput
from engine.scheduler.scheduler import PreemptionCosts, Scheduler

_ids = itertools.count()


class FakeClock:
    """A clock for Scheduler(clock=...): returns `now`, moved by hand."""

    def __init__(self, now: float = 0.0):
        self.now = now

    def __call__(self) -> float:
        return self.now


def make_scheduler(num_blocks: int = 64, block_size: int = 4, num_host_blocks: int = 0,
                   enable_prefix_caching: bool = True, max_model_len: int = 4096,
                   eos_token_ids=frozenset({0}), costs: PreemptionCosts = PreemptionCosts(),
                   clock=None, speculative: SpeculativeConfig | None = None, layout=None,
                   **scheduler_overrides) -> Scheduler:
    kv = KVCacheManager(num_blocks, block_size, num_host_blocks, enable_prefix_caching, layout)
    return Scheduler(SchedulerConfig(**scheduler_overrides), kv, max_model_len, frozenset(eos_token_ids), costs,
                     clock or FakeClock(), speculative)


def make_request(num_tokens: int = 10, max_tokens: int = 4, prompt: list[int] | None = None, priority: int = 0,
                 arrival_time: float | None = None, **params) -> Request:
    prompt = prompt if prompt is not None else [1 + (next(_ids) * 7 + i) % 97 for i in range(num_tokens)]
    return Request(f"r{next(_ids)}", prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True, **params),
                   priority=priority, arrival_time=arrival_time)


def run_steps(engine, requests: dict[str, tuple[list[int], SamplingParams]], flush_every: int = 1,
              max_steps: int | None = None) -> tuple[dict[str, list[RequestOutput]], dict[str, Exception]]:
    """Adds `requests` (id -> (prompt, params)) to an LLMEngine and steps it until nothing is left
    (or `max_steps`), each step but every `flush_every`-th holding its deltas, as the engine
    process's loop does between flushes: each request's outputs, and the errors by request."""
    for request_id, (prompt, params) in requests.items():
        engine.add_request(request_id, prompt, params)
    outputs, errors = {request_id: [] for request_id in requests}, {}
    for step in itertools.count(1):
        if not engine.has_unfinished_requests() or (max_steps is not None and step > max_steps):
            break
        for event in engine.step(hold_deltas=step % flush_every != 0):
            if isinstance(event, RequestError):
                errors[event.request_id] = event.error
            else:
                outputs[event.request_id].append(event)
    return outputs, errors


def choices(outputs: list[RequestOutput]) -> dict[int, tuple[list[int], str, str | None, list | None]]:
    """A request's deltas joined: each choice's tokens, text, finish reason and logprobs (if any)."""
    joined: dict[int, tuple[list[int], str, str | None, list | None]] = {}
    for output in outputs:
        for o in output.outputs:
            tokens, text, _, logprobs = joined.get(o.index, ([], "", None, None))
            if o.logprobs is not None:
                logprobs = (logprobs or []) + o.logprobs
            joined[o.index] = (tokens + o.token_ids, text + o.text, o.finish_reason, logprobs)
    return joined


def ragged_batch(seed: int, shapes: list[tuple[int, int]], num_blocks: int, block_size: int
                 ) -> list[ScheduledRequest]:
    """A scheduled request per (start_pos, num_new), each with blocks of its own drawn at random."""
    gen = torch.Generator().manual_seed(seed)
    free = torch.randperm(num_blocks, generator=gen).tolist()
    scheduled = []
    for start, n in shapes:
        table = [free.pop() for _ in range(-(-(start + n) // block_size))]
        request = make_request(start + n)
        scheduled.append(ScheduledRequest(request, request.token_ids[start:], start, [table], True))
    return scheduled


@dataclass
class AttentionCase:
    """A ragged batch of decodes and chunks (with cached context or without) for an attention
    backend: each request's keys and values (context and new tokens) and the step's queries,
    float32 on the CPU, requests in the order of the batch's rows."""
    scheduled: list[ScheduledRequest]
    inputs: ModelInputs
    q: torch.Tensor  # (tokens, heads, head_dim)
    keys: list[torch.Tensor]  # per request (context + new tokens, kv_heads, head_dim)
    values: list[torch.Tensor]
    num_blocks: int
    block_size: int
    window: int | None = None  # a sliding window: blocks before each request's are the poisoned one
    poison_block: int | None = None  # a block of NaNs: read, it turns the output to NaN

    @property
    def scale(self) -> float:
        return self.q.shape[-1] ** -0.5


def attention_case(seed: int, shapes: list[tuple[int, int]], block_size: int, heads: int, kv_heads: int,
                   head_dim: int, device: torch.device, window: int | None = None) -> AttentionCase:
    """`shapes`: (cached context, new tokens) per request; the inputs are built for `device`. With
    a `window`, each table's blocks before the first one the request's window reads point at a
    block of NaNs, as a sliding group's dropped blocks hold whatever others wrote since."""
    from engine.kv_cache.layout import KVGroup
    from engine.runner.inputs import build_inputs

    gen = torch.Generator().manual_seed(seed)
    num_blocks = sum(-(-(a + b) // block_size) for a, b in shapes) + 8
    scheduled = ragged_batch(seed, shapes, num_blocks - 1, block_size)
    poison = num_blocks - 1 if window is not None else None
    if window is not None:
        for item in scheduled:
            first = KVGroup(window, ()).first_needed_block(item.start_pos, block_size)
            item.block_tables[0][:first] = [poison] * first
    inputs = build_inputs(scheduled, block_size, device, (window,))
    ordered = sorted(scheduled, key=lambda s: (len(s.token_ids) > 1, s.start_pos if len(s.token_ids) == 1 else 0))
    keys = [torch.randn(s.start_pos + len(s.token_ids), kv_heads, head_dim, generator=gen) for s in ordered]
    values = [torch.randn(k.shape, generator=gen) for k in keys]
    q = torch.randn(inputs.input_ids.shape[0], heads, head_dim, generator=gen)
    return AttentionCase(ordered, inputs, q, keys, values, num_blocks, block_size, window, poison)


def run_attention(backend, case: AttentionCase, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """The backend's output for the case in `dtype`, as float32 on the CPU: each request's cached
    context written straight into its blocks, the new tokens' keys and values given to forward."""
    heads, head_dim = case.q.shape[1:]
    kv_heads = case.keys[0].shape[1]
    from engine.attention.base import BlockMajorCache

    cache = backend.allocate_kv_cache(1, case.num_blocks, case.block_size, kv_heads, head_dim, dtype, device)[0]
    if isinstance(backend, BlockMajorCache):  # (2, blocks, block_size, kv_heads, d): a slot is one row
        flat = cache.view(2, -1, kv_heads, head_dim)
    else:  # (2, kv_heads, blocks, block_size, d): a slot's heads apart
        flat = cache.view(2, kv_heads, -1, head_dim).transpose(1, 2)
    if case.poison_block is not None:
        first = case.poison_block * case.block_size
        flat[:, first:first + case.block_size] = float("nan")
    for s, keys, values in zip(case.scheduled, case.keys, case.values):
        table = s.block_tables[0]
        kept = [p for p in range(s.start_pos) if table[p // case.block_size] != case.poison_block]
        slots = torch.tensor([table[p // case.block_size] * case.block_size + p % case.block_size for p in kept],
                             dtype=torch.long, device=device)
        flat[0, slots] = keys[kept].to(device, dtype)
        flat[1, slots] = values[kept].to(device, dtype)
    k = torch.cat([keys[s.start_pos:] for s, keys in zip(case.scheduled, case.keys)]).to(device, dtype)
    v = torch.cat([values[s.start_pos:] for s, values in zip(case.scheduled, case.values)]).to(device, dtype)
    out = backend.forward(case.q.to(device, dtype), k, v, cache, backend.build_metadata(case.inputs)[0])
    return out.view(-1, heads, head_dim).float().cpu()


def expected_attention(case: AttentionCase, dtype: torch.dtype, softcap: float | None = None
                       ) -> list[tuple[slice, torch.Tensor]]:
    """Per request, its rows of the output and float32 causal attention over its queries, keys
    and values rounded to `dtype` (what a backend in `dtype` is held to), within the case's window,
    scores soft-capped by `softcap` (transformers' eager order: scale, cap, mask)."""
    group = case.q.shape[1] // case.keys[0].shape[1]
    starts = case.inputs.query_start_loc
    expected = []
    for b, (s, keys, values) in enumerate(zip(case.scheduled, case.keys, case.values)):
        rows = slice(int(starts[b]), int(starts[b + 1]))
        kk = keys.to(dtype).float().repeat_interleave(group, dim=1)
        vv = values.to(dtype).float().repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,khd->hqk", case.q[rows].to(dtype).float(), kk) * case.scale
        if softcap is not None:
            scores = torch.tanh(scores / softcap) * softcap
        num_queries = rows.stop - rows.start
        key_pos, query_pos = torch.arange(kk.shape[0])[None, :], (s.start_pos + torch.arange(num_queries))[:, None]
        visible = key_pos <= query_pos
        if case.window is not None:
            visible &= key_pos > query_pos - case.window
        weights = scores.masked_fill(~visible, float("-inf")).softmax(-1)
        expected.append((rows, torch.einsum("hqk,khd->qhd", weights, vv)))
    return expected


def decode_outputs_however_split(backend, q, k, v, cache, metadata) -> list[torch.Tensor]:
    """A decode batch's output from the paged backend with one program per partition, a few
    programs walking several partitions each, and partial results sized for the longest context
    the model allows: as a CUDA graph's padded bucket and an eager step split it."""
    import dataclasses

    outputs = []
    for programs in (1, 3, metadata.decodes.parts):
        for parts in (metadata.decodes.parts, backend.max_parts):
            split = dataclasses.replace(metadata.decodes, programs=programs, parts=parts)
            outputs.append(backend.forward(q, k, v, cache, dataclasses.replace(metadata, decodes=split)))
    return outputs


def check_fused_kernels(device: torch.device, dtype: torch.dtype) -> None:
    """RMSNorm, the gated activations and RoPE with the KV write, each one Triton kernel, against the torch ops they
    replace in the same dtype: equal but for the last bit of a rounding tie. RMSNorm with the
    residual add before it: the sum torch's add gives, and the RMSNorm kernel's bits of it."""
    import torch.nn.functional as F

    from engine.attention.triton_paged import PagedMetadata, TritonPagedBackend
    from engine.models import cuda_ops
    from engine.models.decoder import _rope

    gen = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(37, 576, device=device, generator=gen).to(dtype)
    weight = torch.randn(576, device=device, generator=gen).to(dtype)
    expected = F.rms_norm(x.float(), (576,), None, 1e-5).to(dtype) * weight
    torch.testing.assert_close(cuda_ops.rms_norm(x, weight, 1e-5), expected)
    residual = torch.randn(37, 576, device=device, generator=gen).to(dtype)
    total, normed = cuda_ops.add_rms_norm(x, residual, weight, 1e-5)
    assert torch.equal(total, residual + x)
    assert torch.equal(normed, cuda_ops.rms_norm(residual + x, weight, 1e-5))
    gate_up = torch.randn(37, 2 * 1536, device=device, generator=gen).to(dtype)
    gate, up = gate_up.chunk(2, dim=-1)
    from engine.models.linear import GATED_ACTIVATIONS as codes

    torch.testing.assert_close(cuda_ops.gated(gate_up, codes["silu"]), F.silu(gate) * up)
    torch.testing.assert_close(cuda_ops.gated(gate_up, codes["gelu_tanh"]), F.gelu(gate, approximate="tanh") * up)
    torch.testing.assert_close(cuda_ops.gated(gate_up, codes["gelu"]), F.gelu(gate) * up)

    tokens, heads, kv_heads, head_dim, block_size = 37, 9, 3, 64, 16
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, device=device, generator=gen).to(dtype)
    cos, sin = (torch.randn(tokens, head_dim, device=device, generator=gen).to(dtype) for _ in range(2))
    backend = TritonPagedBackend(AttentionParams(head_dim ** -0.5), 2048)
    cache = backend.allocate_kv_cache(1, 8, block_size, kv_heads, head_dim, dtype, device)[0]
    slots = torch.randperm(8 * block_size, device=device, generator=gen)[:tokens]
    qk = backend.rope_and_write(qkv, cos, sin, cache, PagedMetadata(slots, 0, None, None, None, None, []), heads)
    rotated = _rope(qkv[:, :(heads + kv_heads) * head_dim].view(tokens, heads + kv_heads, head_dim), cos[:, None],
                    sin[:, None])
    torch.testing.assert_close(qk, rotated)
    flat = cache.view(2, -1, kv_heads, head_dim)
    torch.testing.assert_close(flat[0, slots], rotated[:, heads:])
    assert torch.equal(flat[1, slots], qkv[:, (heads + kv_heads) * head_dim:].view(tokens, kv_heads, head_dim))


def sampled(out: SchedulerOutput, token: int = 5) -> ModelRunnerOutput:
    """What a runner would return if it sampled `token` for every request due a token."""
    return ModelRunnerOutput({s.request.request_id: [token] for s in out.scheduled if s.sample}, {})


def step(sched: Scheduler, token: int = 5) -> SchedulerOutput:
    """One scheduler step with `token` sampled for everyone; checks block accounting after it."""
    out = sched.schedule()
    sched.update_from_output(out, sampled(out, token))
    sched.kv.check_integrity()
    return out


def hf_greedy(model_dir: str, prompts: list[list[int]], max_new_tokens: int, device: str = "cpu",
              dtype: torch.dtype = torch.float32, ignore_eos: bool = False) -> list[list[int]]:
    """transformers' own greedy generate, one prompt at a time: cut after the first eos, or with
    `ignore_eos` every one of the max_new_tokens."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(device).eval()
    eos = model.generation_config.eos_token_id
    results = []
    for prompt in prompts:
        out = model.generate(torch.tensor([prompt], device=device), max_new_tokens=max_new_tokens, do_sample=False,
                             min_new_tokens=max_new_tokens if ignore_eos else 0,
                             attention_mask=torch.ones(1, len(prompt), dtype=torch.long, device=device),
                             pad_token_id=eos)
        tokens = out[0, len(prompt):].tolist()
        results.append(tokens[:tokens.index(eos) + 1] if eos in tokens and not ignore_eos else tokens)
    return results


@torch.no_grad()
def greedy_gaps(model_dir: str, prompts: list[list[int]], outputs: list[list[int]], device: str = "cpu") -> list[float]:
    """For every generated token: how far its logit is below the best one under transformers'
    float32 model, teacher-forced on the engine's own output (0 where the engine took the argmax).
    Judges reduced-precision greedy decoding token by token: its output may leave the float32
    path at a near tie, and every token after that is still checked on the path it took."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to(device).eval()
    gaps = []
    for prompt, output in zip(prompts, outputs):
        logits = model(torch.tensor([prompt + output], device=device)).logits[0, len(prompt) - 1:-1]
        chosen = logits.gather(1, torch.tensor(output, device=device)[:, None])[:, 0]
        gaps += (logits.max(dim=-1).values - chosen).tolist()
    return gaps


def assert_as_faithful_as_transformers(model_dir: str, prompts: list[list[int]], outputs: list[list[int]],
                                       reference: list[list[int]], device: str = "cpu") -> None:
    """16-bit greedy output cannot equal float32's token for token (near ties flip), so it is
    judged by its distance from float32 (greedy_gaps), against transformers' own greedy output
    in the same dtype (`reference`): the engine may not stray measurably further."""
    gaps = greedy_gaps(model_dir, prompts, outputs, device)
    reference_gaps = greedy_gaps(model_dir, prompts, reference, device)
    mean, reference_mean = sum(gaps) / len(gaps), sum(reference_gaps) / len(reference_gaps)
    argmax, reference_argmax = (sum(g == 0 for g in x) / len(x) for x in (gaps, reference_gaps))
    assert mean <= 2 * reference_mean + 0.02, (mean, reference_mean)
    assert argmax >= reference_argmax - 0.1, (argmax, reference_argmax)


def repetitive_prompts(num: int, seed: int = 0) -> list[list[int]]:
    """Prompts that repeat spans of themselves (what prompt lookup is for), of varied lengths."""
    rng = random.Random(seed)
    prompts = []
    for _ in range(num):
        span = [rng.randrange(3, 300) for _ in range(rng.randint(3, 12))]
        prompts.append([rng.randrange(3, 300) for _ in range(rng.randint(0, 20))] + span * rng.randint(2, 4))
    return prompts


def save_first_layer(model_dir: str, path) -> str:
    """A separate draft checkpoint: the model's first layer with its norm and LM head, saved as a
    one-layer model (so it agrees with the model often, not always)."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.model.layers = model.model.layers[:1]
    model.config.num_hidden_layers = 1
    model.save_pretrained(path)
    AutoTokenizer.from_pretrained(model_dir).save_pretrained(path)
    return str(path)

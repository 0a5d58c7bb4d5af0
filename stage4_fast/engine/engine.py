"""The engine of one TP rank: model shard, KV pool, page table, backends, graphs, sampler; runs one batch. With
tp > 1 every rank runs the same batches in lock-step and the layers' collectives join the partial results."""

from __future__ import annotations

import logging
import math
import time
from contextlib import contextmanager
from typing import Callable, Iterator, NamedTuple

import torch

from ..attention import create_attention_backend, kv_cache_dtype_problem, resolve_auto_backend, validate_attn_backend
from ..attention.hybrid_linear import HybridLinearAttnBackend
from ..core import Batch, Context, Req, SamplingParams, release_global_ctx, set_global_ctx
from ..distributed import destroy_distributed, init_process_group, reset_tp_info, set_tp_info
from ..kernel.ref import is_fp8
from ..kvcache import create_kvcache_pool, kv_cache_dtype_name, resolve_kv_cache_dtype
from ..kvcache.state_pool import create_state_pool
from ..layers import set_rope_device
from ..layers.linear import warm_up_gemms
from ..models import ModelConfig, create_model, load_weight
from ..models.weight import KV_SCALE_NAME, kv_scale_name
from ..moe import create_moe_backend, resolve_auto_moe_backend
from ..sampling import BatchLogprobs
from ..utils import align_ceil, div_even, torch_dtype
from ..utils.device import (
    Event,
    create_stream,
    current_stream,
    free_device_memory,
    is_cuda,
    physical_cpu_count,
    record_event,
    stream_context,
    synchronize,
)
from ..utils.hf import load_tokenizer, resolve_model_path
from .config import EngineConfig
from .graph import GraphRunner
from .prefill_graph import PrefillGraphRunner, padding_prefill_batch, prefill_graph_problem, prefill_graph_sizes
from .sample import BatchSamplingArgs, Sampler

logger = logging.getLogger(__name__)

# on CPU a fixed KV budget (host RAM is shared; untouched pages cost nothing), not upstream's share of free memory
CPU_KV_CACHE_BYTES = 1 << 30


class ForwardOutput(NamedTuple):
    next_tokens_gpu: torch.Tensor  # on the engine device (the name is upstream's)
    next_tokens_cpu: torch.Tensor  # host copy; valid once copy_done_event has completed
    copy_done_event: Event
    logprobs: BatchLogprobs | None = None  # host copies, for the requests that asked (valid with the tokens)


# --calculate-kv-scales: a layer's K / V scale is its absmax over this text / headroom (vLLM's K_SCALE_CONSTANT and
# V_SCALE_CONSTANT), leaving room up to e4m3's 448 for larger values than the text's
KV_SCALE_HEADROOM = (200.0, 100.0)
KV_CALIBRATION_TEXT = (
    "The quick brown fox jumps over the lazy dog. In 1969 two astronauts walked on the Moon while a third orbited "
    "above them. To sort a list, compare each pair of neighbours and swap them until nothing moves.\n"
    "User: What is the capital of France?\nAssistant: The capital of France is Paris.")


def kv_scales_from_absmax(absmax: torch.Tensor) -> torch.Tensor:
    """[2 (k/v), ...] absmax -> scales: absmax / KV_SCALE_HEADROOM rounded up to a power of two (1.0 where absmax
    is 0). Unlike vLLM's: dividing by a power of two re-rounds no value of e4m3's normal range, it only lifts smaller
    ones (which lose mantissa bits) into it; a scale <= 1 stores no value up to 448 x scale worse than 1.0 does."""
    headroom = torch.tensor(KV_SCALE_HEADROOM, device=absmax.device).view(2, *[1] * (absmax.dim() - 1))
    return torch.where(absmax > 0, torch.exp2(torch.ceil(torch.log2(absmax / headroom))), 1.0)


# Engine.warm_up_gemms: every 16th row count (cuBLAS mostly reuses its choice in between), at most 512 of them
GEMM_WARM_UP_STEP = 16
GEMM_WARM_UP_COUNTS = 512


class Engine:
    def __init__(self, config: EngineConfig):
        tp = config.tp_info
        set_tp_info(tp.rank, tp.size)
        self.device = torch.device(f"cuda:{config.local_rank}") if torch.cuda.is_available() else torch.device("cpu")
        self.config = config = self._adjust_config(config, self.device)
        model_path = resolve_model_path(config.model_path)
        if is_cuda(self.device):
            torch.cuda.set_device(self.device)
        else:
            # memory-bound GEMMs: physical cores only, shared among the machine's ranks
            torch.set_num_threads(max(1, physical_cpu_count() // config.ranks_per_node))
        torch.manual_seed(42)
        self.stream = create_stream(self.device)
        self.dtype = config.dtype
        self.kv_dtype = resolve_kv_cache_dtype(config.kv_cache_dtype, config.dtype)
        self._checkpoint_kv_scales: dict[str, float] = {}  # fp8 KV scales found in the checkpoint (_load_weights)
        self.ctx = Context(page_size=config.page_size)
        set_global_ctx(self.ctx)
        # gloo group for host-side messages (None with one rank); GPU tensors go through NCCL
        self.tp_cpu_group = init_process_group(tp, config.distributed_addr, self.device, config.distributed_timeout)
        free_memory = self._sync_free_memory()

        with stream_context(self.stream):
            model_config = config.model_config
            set_rope_device(self.device)
            with torch.device("meta"), torch_dtype(config.dtype):
                self.model = create_model(model_config)
            self.model.load_state_dict(self._load_weights(model_path))
            self.model.after_load()

            # hybrid models' linear-attention state (+1: the dummy's slot), before the KV pool is sized
            self.state_pool = (create_state_pool(model_config, config.max_running_req + 1, config.dtype, self.device)
                               if model_config.linear_attn is not None else None)
            self.num_pages = self._num_pages()
            # one extra page at the end: the dummy request's (padding) slots
            self.kv_cache = self.ctx.kv_cache = create_kvcache_pool(model_config, self.num_pages + 1, config.page_size,
                                                                    config.dtype, self.device, self.kv_dtype)
            kv_scales = self._set_kv_scales(model_config)
            self.max_seq_len = min(config.max_seq_len, self.num_pages * config.page_size)
            self.page_table = self.ctx.page_table = torch.zeros(
                config.max_running_req + 1, align_ceil(self.max_seq_len, 32), dtype=torch.int32, device=self.device
            )
            self._create_backends(model_config)
            self.dummy_req = Req(input_ids=torch.tensor([0], dtype=torch.int32), table_idx=config.max_running_req,
                                 cached_len=0, output_len=1, uid=-1, sampling_params=SamplingParams())
            if config.calculate_kv_scales and not self._checkpoint_kv_scales:  # before capture bakes them in
                kv_scales = self._calculate_kv_scales()
            self.page_table[self.dummy_req.table_idx].fill_(self.num_pages * config.page_size)
            self.graph_runner = GraphRunner(
                stream=self.stream, device=self.device, model=self.model, attn_backend=self.attn_backend,
                cuda_graph_bs=config.cuda_graph_bs, cuda_graph_max_bs=self._graph_max_bs(), free_memory=free_memory,
                max_seq_len=self.max_seq_len, vocab_size=model_config.vocab_size, dummy_req=self.dummy_req,
                logits_dtype=config.dtype)
        self.prefill_graph: PrefillGraphRunner | None = None  # capture_prefill_graph
        self._log_start(kv_scales)

    def _create_backends(self, model_config: ModelConfig) -> None:
        config = self.config
        self.attn_backend = self.ctx.attn_backend = create_attention_backend(config.attention_backend, model_config)
        if self.state_pool is not None:
            self.attn_backend = self.ctx.attn_backend = HybridLinearAttnBackend(self.attn_backend, self.state_pool,
                                                                                model_config.linear_attn)
        if model_config.is_moe:
            self.moe_backend = self.ctx.moe_backend = create_moe_backend(config.moe_backend)
        self.sampler = Sampler(self.device, model_config.vocab_size)

    def _log_start(self, kv_scales: str) -> None:
        config, runner, tp = self.config, self.graph_runner, self.config.tp_info
        graphs = (f"{'emulated' if runner.emulated else 'CUDA'} graphs for batch sizes up to {runner.max_graph_bs}"
                  if runner.max_graph_bs else "no graphs")
        logger.info("rank %d/%d on %s: attention %s, MoE %s, %s, %d KV pages of %d in %s%s", tp.rank, tp.size,
                    self.device, config.attention_backend, config.moe_backend if config.model_config.is_moe else "-",
                    graphs, self.num_pages, config.page_size, kv_cache_dtype_name(self.kv_dtype), kv_scales)

    @staticmethod
    def _adjust_config(config: EngineConfig, device: torch.device) -> EngineConfig:
        # like upstream, "auto" is resolved in place on the frozen config
        validate_attn_backend(config.attention_backend)
        kv_dtype = resolve_kv_cache_dtype(config.kv_cache_dtype, config.dtype)
        if config.attention_backend == "auto":
            object.__setattr__(config, "attention_backend", resolve_auto_backend(device, config.dtype, kv_dtype))
        if why := kv_cache_dtype_problem(config.attention_backend, config.dtype, kv_dtype):
            raise ValueError(f"kv_cache_dtype={config.kv_cache_dtype}: {why}")
        if config.calculate_kv_scales and not is_fp8(kv_dtype):
            raise ValueError(f"calculate_kv_scales needs an fp8 kv_cache_dtype, not {config.kv_cache_dtype!r}")
        if config.moe_backend == "auto":
            object.__setattr__(config, "moe_backend", resolve_auto_moe_backend(device))
        return config

    def _graph_max_bs(self) -> int | None:
        """0 for the torch backend on a GPU (it reads lengths on the host: no real CUDA graph)."""
        uses_torch = "torch" in self.config.attention_backend.split(",")[-1:]
        if is_cuda(self.device) and uses_torch and self.config.cuda_graph_bs is None:
            return 0
        return self.config.cuda_graph_max_bs

    def _sync_free_memory(self) -> int:
        """Free device memory; with several ranks the minimum, so every rank sizes the same KV pool."""
        free = free_device_memory(self.device)
        if self.tp_cpu_group is not None:
            t = torch.tensor([free, -free], dtype=torch.int64)
            torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MIN, group=self.tp_cpu_group)
            low, high = int(t[0]), -int(t[1])
            if high - low > 2 * (1 << 30):
                raise RuntimeError(f"free memory differs too much across ranks: {low} vs {high} bytes")
            free = low
        return free

    def _load_weights(self, model_path: str) -> dict[str, torch.Tensor]:
        if self.config.use_dummy_weight:
            shapes = self.model.state_dict()
            return {k: torch.randn(v.shape, dtype=self.dtype, device=self.device) * 0.02 for k, v in shapes.items()}
        mc = self.config.model_config
        # each tensor is converted as it streams in: the dict ends up holding the model's only copy
        weights = load_weight(model_path, self.device, mc.num_kv_heads, mc.num_experts if mc.is_moe else 0)
        state: dict[str, torch.Tensor] = {}
        for name, tensor in weights:
            if kv_scale_name(name) is not None:  # read by the KV pool, not the model; kept in fp32
                # per-tensor scales; a per-head vector is reduced to its largest entry (no value then overflows)
                self._checkpoint_kv_scales[name] = float(tensor.float().max())
            else:
                state[name] = tensor.to(self.dtype)
        return state

    def _set_kv_scales(self, model_config: ModelConfig) -> str:
        """Give an fp8 pool the checkpoint's per-layer scales (1.0 where none); returns the start-up log's words."""
        found = self._checkpoint_kv_scales
        if not is_fp8(self.kv_dtype):
            return f" (checkpoint KV scales unused: {len(found)})" if found else ""
        scales = {"k": [1.0] * self.kv_cache.num_layers, "v": [1.0] * self.kv_cache.num_layers}
        for name, value in found.items():
            match = KV_SCALE_NAME.search(name)
            index = model_config.kv_layer_index(int(match["layer"]))
            if index is None or index >= self.kv_cache.num_layers:
                raise ValueError(f"KV scale {name!r} names a layer without a KV cache")
            scales[match["kv"]][index] = value
        self.kv_cache.set_scales(scales["k"], scales["v"])
        return f", {len(found)} KV scales from the checkpoint" if found else ", KV scales 1.0"

    def _calculate_kv_scales(self) -> str:
        """Per-layer scales from data, as vLLM's --calculate-kv-scales: one prefill of KV_CALIBRATION_TEXT in the
        padding row (its slots from 0 on, free at start-up) records each layer's K and V absmax where the attention
        backend receives them. Runs before graph capture, which bakes the scales in."""
        vocab_size = self.config.model_config.vocab_size
        try:
            ids = load_tokenizer(self.config.model_path)(KV_CALIBRATION_TEXT).input_ids
        except (OSError, ValueError):
            ids = []
        if len(set(ids)) < 16 or max(ids) >= vocab_size:  # no real tokenizer: fixed ids spread over the vocabulary
            ids = [i * 7919 % vocab_size for i in range(1, 97)]
        n, backend, forward = min(len(ids), self.max_seq_len), self.attn_backend, self.attn_backend.forward
        absmax = torch.zeros(2, self.kv_cache.num_layers, device=self.device)

        def recording_forward(q, k, v, layer_id, batch, kv_stored=False):
            absmax[:, layer_id] = torch.stack([k.abs().max(), v.abs().max()]).float()
            return forward(q, k, v, layer_id, batch, kv_stored)

        batch = padding_prefill_batch(self.dummy_req, [n])
        batch.positions = batch.out_loc = torch.arange(n, dtype=torch.int32, device=self.device)
        self.page_table[self.dummy_req.table_idx, :n] = batch.out_loc
        batch.input_ids = torch.tensor(ids[:n], dtype=torch.int32, device=self.device)
        backend.forward = recording_forward  # the layers call ctx.attn_backend.forward
        try:
            with torch.inference_mode(), self.ctx.forward_batch(batch):
                backend.prepare_metadata(batch)
                self.model.forward()
        finally:
            del backend.forward
        k, v = kv_scales_from_absmax(absmax).tolist()
        self.kv_cache.set_scales(k, v)
        return f", KV scales from {n} calibration tokens (K {min(k):.3g}-{max(k):.3g}, V {min(v):.3g}-{max(v):.3g})"

    def _num_pages(self) -> int:
        config = self.config
        if config.num_page_override is not None:
            return config.num_page_override
        mc = config.model_config
        kv_heads_local = div_even(mc.num_kv_heads, config.tp_info.size, allow_replicate=True)
        bytes_per_page = 2 * mc.head_dim * kv_heads_local * config.page_size * self.kv_dtype.itemsize * mc.num_kv_layers
        if is_cuda(self.device):
            budget = int(self._sync_free_memory() * config.memory_ratio)  # after the weights: same on every rank
        else:
            budget = CPU_KV_CACHE_BYTES
        num_pages = budget // bytes_per_page
        assert num_pages > 1, "not enough memory for the KV cache"
        return num_pages

    def forward_batch(self, batch: Batch, args: BatchSamplingArgs,
                      before_sampling: Callable[[], None] | None = None) -> ForwardOutput:
        """Forward, sample, start the tokens' copy to the host. ``before_sampling``: host work overlapping the
        launched forward, before the sampler reads ``args`` (grammar masks are filled after it)."""
        if is_cuda(self.device):
            assert current_stream(self.device) == self.stream, "run forward_batch on the engine stream"
        # Several engines may live in one process (tests); the layers read the global context, so make it ours.
        set_global_ctx(self.ctx)
        with torch.inference_mode(), self.ctx.forward_batch(batch):
            if args.logprobs is not None:
                batch.prompt_logprob_rows = args.logprobs.prompt_rows
            logits, greedy_tokens = self.forward_logits(batch)
            for req in batch.reqs:
                req.complete_one()
            if before_sampling is not None:
                before_sampling()
            self.sampler.fill_grammar_mask(args)
            next_tokens_gpu = self.sampler.sample(logits[: batch.size], args, greedy_tokens).to(torch.int32)
            logprobs = self.sampler.logprobs(logits[: batch.size], next_tokens_gpu, args, batch,
                                             self.model.lm_head.compute_logits)
            batch.prompt_hidden = None
            next_tokens_cpu = next_tokens_gpu.to("cpu", non_blocking=True)
            logprobs_cpu = logprobs.to_host() if logprobs is not None else None
            copy_done_event = record_event(self.device)
        return ForwardOutput(next_tokens_gpu, next_tokens_cpu, copy_done_event, logprobs_cpu)

    def pad_batch(self, batch: Batch) -> None:  # up to its (decode or prefill) graph's size
        if batch.is_prefill and self.prefill_graph is not None:
            self.prefill_graph.pad_batch(batch)
        else:
            self.graph_runner.pad_batch(batch)

    def forward_logits(self, batch: Batch) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Logits (and a decode graph's greedy argmax) from a graph replay or the eager forward."""
        if self.graph_runner.can_use_cuda_graph(batch):
            return self.graph_runner.replay(batch), self.graph_runner.greedy_tokens(batch)
        if self.prefill_graph is not None and self.prefill_graph.can_replay(batch):
            return self.prefill_graph.replay(batch), None
        return self.model.forward(), None

    @contextmanager
    def _survive_oom(self, collective: bool, message: str, *args: object) -> Iterator[None]:
        """A start-up step that ran out of GPU memory: warn with ``message`` and serve without it. A step with
        collectives re-raises under TP: the other ranks may have got further into them, and must not diverge."""
        try:
            yield
        except torch.OutOfMemoryError:
            if collective and self.config.tp_info.size > 1:
                raise
            torch.cuda.empty_cache()
            logger.warning(message, *args)

    def warm_up_prefill(self, num_tokens: int, num_reqs: int = 1) -> None:
        """A dummy prefill step at start-up (KV to the padding slot): CUDA loads a kernel's module at first launch."""
        num_tokens = min(num_tokens, self.max_seq_len)
        num_reqs = max(1, min(num_reqs, num_tokens // 2, self.config.max_running_req))
        if num_tokens < 2:
            return
        lens = [num_tokens // num_reqs + (i < num_tokens % num_reqs) for i in range(num_reqs)]
        batch = padding_prefill_batch(self.dummy_req, lens)
        positions = torch.cat([torch.arange(n, dtype=torch.int32) for n in lens])
        set_global_ctx(self.ctx)
        with self._survive_oom(True, "a prefill of %d tokens ran out of GPU memory at start-up: prefill steps that "
                               "long will too (lower --max-num-batched-tokens or --mem-fraction-static)", num_tokens):
            with torch.inference_mode(), stream_context(self.stream):
                batch.input_ids = torch.zeros(num_tokens, dtype=torch.int32, device=self.device)
                batch.positions = positions.to(self.device)
                batch.out_loc = self.page_table[self.dummy_req.table_idx, positions.to(self.device, torch.int64)]
                self.attn_backend.prepare_metadata(batch)
                self.forward_batch(batch, BatchSamplingArgs(temperatures=None)).copy_done_event.synchronize()
            synchronize(self.device)

    def capture_prefill_graph(self, num_tokens: int) -> None:
        """Capture the prefill forward at a grid of token counts up to ``num_tokens`` (engine/prefill_graph.py)."""
        if why := self._prefill_graph_problem(num_tokens):
            logger.info("prefill steps run eagerly: %s", why)
            return
        with self._survive_oom(True, "capturing the prefill forward up to %d tokens ran out of GPU memory: prefill "
                               "steps run eagerly (lower --mem-fraction-static to leave room for it)", num_tokens):
            self.prefill_graph = PrefillGraphRunner(self.stream, self.device, self.model, self.attn_backend,
                                                    prefill_graph_sizes(num_tokens), self.config.max_running_req,
                                                    self.dummy_req)

    def _prefill_graph_problem(self, num_tokens: int) -> str | None:
        wanted = self.config.prefill_cuda_graph
        if wanted is False or (wanted is None and not is_cuda(self.device)):
            return "prefill graphs are off"
        if self.graph_runner.max_graph_bs == 0:
            return "CUDA graphs are off"
        if self.config.model_config.is_moe:
            return "MoE layers route tokens by their values"
        if num_tokens > self.max_seq_len:
            return f"a {num_tokens}-token step is longer than the longest sequence ({self.max_seq_len})"
        return prefill_graph_problem(self.model, self.attn_backend)

    def warm_up_gemms(self, max_tokens: int, step: int = GEMM_WARM_UP_STEP) -> None:
        """Every projection at a grid of row counts, the LM head at every request count: cuBLAS picks at first sight."""
        step = max(step, math.ceil(max_tokens / GEMM_WARM_UP_COUNTS / step) * step)
        rows = [*range(1, step), *range(step, max_tokens + 1, step), max_tokens]
        start = time.perf_counter()
        # no collective runs: the ranks cannot diverge
        with self._survive_oom(False, "the GEMM warm-up of %d rows ran out of GPU memory; serving without it",
                               max_tokens):
            with torch.inference_mode(), stream_context(self.stream):
                num_layers = warm_up_gemms(self.model, rows)
                max_reqs = min(self.config.max_running_req, max_tokens, GEMM_WARM_UP_COUNTS)
                hidden = torch.zeros(max_reqs, self.config.model_config.hidden_size, dtype=self.dtype,
                                     device=self.device)
                for n in range(1, len(hidden) + 1):
                    self.model.lm_head.warm_up_gemms(hidden[:n])
            synchronize(self.device)
            logger.info("warmed %d projections at %d row counts and the LM head at 1-%d rows in %.1f s", num_layers,
                        len(set(rows)), len(hidden), time.perf_counter() - start)

    def shutdown(self) -> None:
        self.graph_runner.destroy_cuda_graphs()  # before the process group goes (graphs may hold NCCL work)
        if self.prefill_graph is not None:
            self.prefill_graph.destroy()
        destroy_distributed()
        reset_tp_info()
        release_global_ctx(self.ctx)

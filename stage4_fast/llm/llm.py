"""Offline inference: `LLM(model_path).generate(prompts, sampling_params)` runs the scheduler in this process."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Any, Deque, Dict, List, Sequence, Tuple

import torch
from tqdm import tqdm

from ..core import SamplingParams
from ..distributed import DistributedInfo
from ..message import BaseBackendMsg, BaseTokenizerMsg, DetokenizeMsg, TokenColumnsMsg, TokenLogprobs, UserMsg
from ..scheduler import Scheduler, SchedulerConfig
from ..tokenizer.detokenize import batch_decoder
from ..utils import int_tensor
from ..utils.hf import tp_split_problem
from .tp import join_followers, start_followers, tp_config_fields

# offline nobody waits on a prefill step: on a large GPU, steps twice the server's (as vLLM's LLM class)
OFFLINE_PREFILL_TOKENS_LARGE_GPU = 16384
LARGE_GPU_BYTES = 70 * (1 << 30)


def offline_prefill_tokens() -> int:
    """16,384 on a CUDA GPU of >= 70 GiB other than an A100 (where larger steps lose), else the scheduler's default."""
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(torch.cuda.current_device())
        if props.total_memory >= LARGE_GPU_BYTES and "a100" not in props.name.lower():
            return OFFLINE_PREFILL_TOKENS_LARGE_GPU
    return SchedulerConfig.max_extend_tokens


class RequestAllFinished(Exception):
    """Raised by the offline receive hook when everything is done: ends run_forever."""


@dataclass
class RequestStatus:
    uid: int
    input_ids: List[int]
    output_ids: List[int]
    error: str | None = None  # set when the scheduler rejected or aborted the request
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    logprobs: TokenLogprobs | None = None  # stage 4: when the request asked for them
    prompt_logprobs: TokenLogprobs | None = None  # ... and echo


Prompt = str | Sequence[int]


class LLM(Scheduler):
    def __init__(self, model_path: str, dtype: torch.dtype = torch.bfloat16, tp: int = 1, **kwargs) -> None:
        # kwargs: any EngineConfig / SchedulerConfig field; tp > 1 runs ranks 1..tp-1 in processes of their own
        if tp > 1 and (why := tp_split_problem(model_path, tp)):
            raise ValueError(f"tp={tp}: {why}")
        if kwargs.get("nnodes", 1) != 1:
            raise ValueError("the offline LLM runs on one machine; several machines: the server's --nnodes")
        kwargs.setdefault("max_extend_tokens", offline_prefill_tokens())
        kwargs.setdefault("decode_between_chunks", False)  # nobody reads tokens as they come (scheduler/config.py)
        config = SchedulerConfig(model_path=model_path, tp_info=DistributedInfo(0, tp), dtype=dtype, offline_mode=True,
                                 **tp_config_fields(tp), **kwargs)
        self._followers = start_followers(config) if tp > 1 else []
        super().__init__(config)
        self.pending_requests: Deque[Tuple[Prompt, SamplingParams]] = deque()
        self.status_map: Dict[int, RequestStatus] = {}
        self.counter = 0
        self._pbar: tqdm | None = None

    def _tokenize_one(self, prompt: Prompt) -> torch.Tensor:
        if isinstance(prompt, str):
            assert self.tokenizer is not None  # generate() checked
            ids = self.tokenizer.encode(prompt)  # raw text: no chat template, as upstream
        else:
            ids = list(prompt)
        return int_tensor(ids)

    def offline_receive_msg(self, blocking: bool = False) -> List[BaseBackendMsg]:
        if blocking and not self.pending_requests:
            self.run_when_idle()
            raise RequestAllFinished
        # hand over prompts in portions of about one prefill budget, as upstream
        msgs: List[BaseBackendMsg] = []
        total_len = 0
        while self.pending_requests and total_len < self.prefill_budget:
            prompt, params = self.pending_requests.popleft()
            input_ids = self._tokenize_one(prompt)
            uid, self.counter = self.counter, self.counter + 1
            self.status_map[uid] = RequestStatus(uid, input_ids.tolist(), [], ignore_eos=params.ignore_eos,
                                                 skip_special_tokens=params.skip_special_tokens,
                                                 logprobs=TokenLogprobs() if params.logprobs is not None else None)
            msgs.append(UserMsg(uid, input_ids, params))
            total_len += len(input_ids)
        return msgs

    def offline_send_result(self, reply: List[BaseTokenizerMsg]) -> None:
        for msg in reply:
            if isinstance(msg, TokenColumnsMsg):  # tokens with nothing else to report: output ids only
                for uid, token in zip(msg.uids, msg.tokens):
                    self.status_map[uid].output_ids.append(token)
                continue
            assert isinstance(msg, DetokenizeMsg)
            status = self.status_map[msg.uid]
            if msg.error is not None:
                status.error = msg.error
            elif not (msg.finished and msg.finish_reason == "stop"):
                # (a final EOS or stop token ends the request but is not part of the output)
                status.output_ids.append(msg.next_token)
                if msg.logprobs is not None and status.logprobs is not None:
                    status.logprobs.extend(msg.logprobs)
            if msg.prompt_logprobs is not None:
                status.prompt_logprobs = msg.prompt_logprobs
            if msg.finished and self._pbar is not None:
                self._pbar.update(1)

    def generate(self, prompts: Sequence[str] | Sequence[Sequence[int]],
                 sampling_params: Sequence[SamplingParams] | SamplingParams,
                 use_tqdm: bool = True) -> List[Dict[str, Any]]:
        """One result per prompt, in order: {"text", "token_ids"}, plus "error", "logprobs", "prompt_logprobs"."""
        if isinstance(sampling_params, SamplingParams):
            sampling_params = [sampling_params] * len(prompts)
        if len(sampling_params) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(sampling_params)} sampling params")
        if self.tokenizer is None and any(isinstance(p, str) for p in prompts):
            raise ValueError(f"{self.config.model_path} has no tokenizer: pass token-id prompts")
        self.pending_requests = deque(zip(prompts, sampling_params))
        self.status_map = {}
        self.counter = 0
        with tqdm(total=len(prompts), desc="generate", unit="req", disable=not use_tqdm) as self._pbar:
            try:
                self.run_forever()
            except RequestAllFinished:
                pass
        self._pbar = None
        extras = ("error", "logprobs", "prompt_logprobs")
        return [{"text": text, "token_ids": self.status_map[uid].output_ids}
                | {k: v for k in extras if (v := getattr(self.status_map[uid], k)) is not None}
                for uid, text in enumerate(self._decode_outputs(len(prompts)))]

    def _decode_outputs(self, n: int) -> List[str]:
        """Every output's text, one (parallel) tokenizer call per skip_special_tokens setting."""
        texts = [""] * n
        if self.tokenizer is None:
            return texts
        decode = batch_decoder(self.tokenizer)
        for skip in (True, False):
            uids = [uid for uid in range(n) if self.status_map[uid].skip_special_tokens == skip]
            if uids:
                for uid, text in zip(uids, decode([self.status_map[uid].output_ids for uid in uids], skip)):
                    texts[uid] = text
        return texts

    def shutdown(self) -> None:
        self.stop_followers()
        super().shutdown()
        join_followers(self._followers)

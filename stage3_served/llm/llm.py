"""Offline inference: `LLM(model_path).generate(prompts, sampling_params)` runs the scheduler in this process."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Deque, Dict, List, Sequence, Tuple

import torch
from tqdm import tqdm

from ..core import SamplingParams
from ..distributed import DistributedInfo
from ..message import BaseBackendMsg, DetokenizeMsg, UserMsg
from ..scheduler import Scheduler, SchedulerConfig


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


Prompt = str | Sequence[int]


class LLM(Scheduler):
    def __init__(self, model_path: str, dtype: torch.dtype = torch.bfloat16, **kwargs) -> None:
        # any EngineConfig / SchedulerConfig field may be passed (page_size, cache_type, max_extend_tokens, ...)
        config = SchedulerConfig(model_path=model_path, tp_info=DistributedInfo(0, 1), dtype=dtype, offline_mode=True,
                                 **kwargs)
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
        return torch.tensor(ids, dtype=torch.int32)

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
                                                 skip_special_tokens=params.skip_special_tokens)
            msgs.append(UserMsg(uid, input_ids, params))
            total_len += len(input_ids)
        return msgs

    def offline_send_result(self, reply: List[DetokenizeMsg]) -> None:
        for msg in reply:
            status = self.status_map[msg.uid]
            if msg.error is not None:
                status.error = msg.error
            elif not (msg.finished and msg.finish_reason == "stop"):
                # (a final EOS or stop token ends the request but is not part of the output)
                status.output_ids.append(msg.next_token)
            if msg.finished and self._pbar is not None:
                self._pbar.update(1)

    def generate(self, prompts: Sequence[str] | Sequence[Sequence[int]],
                 sampling_params: Sequence[SamplingParams] | SamplingParams,
                 use_tqdm: bool = True) -> List[Dict[str, str | List[int]]]:
        """One result per prompt, in order: {"text", "token_ids"} (plus "error" for a rejected prompt)."""
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
        results: List[Dict[str, str | List[int]]] = []
        for uid in range(len(prompts)):
            status = self.status_map[uid]
            result: Dict[str, str | List[int]] = {
                "text": (self.tokenizer.decode(status.output_ids, skip_special_tokens=status.skip_special_tokens)
                         if self.tokenizer is not None else ""),
                "token_ids": status.output_ids,
            }
            if status.error is not None:
                result["error"] = status.error
            results.append(result)
        return results

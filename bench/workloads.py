"""The benchmark workloads, in one place so every bench script draws the same requests.

All workloads are token ids (no tokenizer in the loop) and ignore EOS, so every engine does exactly the same work.
The offline ones follow the recipe of upstream's / nano-vllm's `bench.py`: seed the global `random` module, draw all
prompts first, then all output lengths.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Workload:
    name: str
    prompts: list[list[int]]
    output_lens: list[int]
    note: str = ""

    @property
    def prompt_tokens(self) -> int:
        return sum(map(len, self.prompts))

    @property
    def output_tokens(self) -> int:
        return sum(self.output_lens)

    def head(self, n: int) -> Workload:
        """The first n requests (GPU runs of the slow single-request stages use a prefix of the workload)."""
        return Workload(f"{self.name}[:{n}]", self.prompts[:n], self.output_lens[:n], self.note)


def offline_cpu(vocab_size: int, num_seqs: int = 16, prompt_len: tuple[int, int] = (32, 256),
                output_len: tuple[int, int] = (16, 128), seed: int = 0) -> Workload:
    """The CPU offline workload: 16 requests, prompts of randint(32, 256) ids drawn from
    randint(100, vocab - 100), output lengths randint(16, 128)."""
    random.seed(seed)
    prompts = [[random.randint(100, vocab_size - 100) for _ in range(random.randint(*prompt_len))]
               for _ in range(num_seqs)]
    output_lens = [random.randint(*output_len) for _ in range(num_seqs)]
    return Workload(f"offline-cpu-{num_seqs}", prompts, output_lens,
                    f"{num_seqs} reqs, prompt randint{prompt_len}, output randint{output_len}, seed {seed}")


def offline_upstream(num_seqs: int = 256, seed: int = 0) -> Workload:
    """Upstream's (and nano-vllm's) offline benchmark: 256 sequences, prompts of randint(100, 1024) ids drawn from
    randint(0, 10000), output lengths randint(100, 1024); 142,827 prompt and 133,966 output tokens."""
    random.seed(seed)
    prompts = [[random.randint(0, 10000) for _ in range(random.randint(100, 1024))] for _ in range(num_seqs)]
    output_lens = [random.randint(100, 1024) for _ in range(num_seqs)]
    return Workload(f"offline-upstream-{num_seqs}", prompts, output_lens,
                    f"{num_seqs} reqs, prompt randint(100, 1024), output randint(100, 1024), seed {seed}")


def shared_prefix(vocab_size: int, num_seqs: int, system_len: int, question_len: int, output_len: int,
                  seed: int = 1) -> Workload:
    """One long system prompt shared by every request, then a short question of its own (the radix cache's case)."""
    rng = random.Random(seed)
    system = [rng.randint(100, vocab_size - 100) for _ in range(system_len)]
    prompts = [system + [rng.randint(100, vocab_size - 100) for _ in range(question_len)] for _ in range(num_seqs)]
    return Workload(f"shared-prefix-{num_seqs}", prompts, [output_len] * num_seqs,
                    f"{num_seqs} reqs = {system_len}-token shared system prompt + {question_len}-token question, "
                    f"{output_len} output tokens")


def random_prompt(vocab_size: int, length: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randint(100, vocab_size - 100) for _ in range(length)]


@dataclass(frozen=True)
class Sizes:
    """How big each measurement is; `quick` shrinks everything so `python -m bench --quick` stays short."""

    prefill_len: int  # prompt tokens of the prefill measurement
    decode_len: int  # new tokens of the single-stream decode measurement
    repeats: int  # best of this many for prefill / decode
    offline: dict = field(default_factory=dict)  # arguments of offline_cpu / offline_upstream
    slow_stage_seqs: int | None = None  # GPU: stage0 (one request at a time) runs only this prefix of the workload
    serve_clients: tuple[int, ...] = (1, 16)
    serve_requests: dict = field(default_factory=dict)  # concurrency -> number of requests
    serve_prompt_len: tuple[int, int] = (32, 256)
    serve_output_len: int = 64
    prefix: dict = field(default_factory=dict)  # arguments of shared_prefix
    long_prompt_len: int = 2048  # the prompt that arrives while others decode
    long_running: int = 4  # requests decoding when it arrives
    long_running_output: int = 64
    chunk: int = 256  # chunked prefill budget (max_extend_tokens) in the "on" row


SIZES: dict[tuple[str, bool], Sizes] = {
    ("cpu", False): Sizes(
        prefill_len=256, decode_len=128, repeats=3, offline=dict(num_seqs=16),
        serve_requests={1: 4, 16: 32}, prefix=dict(num_seqs=16, system_len=512, question_len=32, output_len=16),
    ),
    ("cpu", True): Sizes(
        prefill_len=128, decode_len=32, repeats=2,
        offline=dict(num_seqs=8, prompt_len=(32, 128), output_len=(8, 32)),
        serve_requests={1: 2, 16: 16}, serve_prompt_len=(32, 128), serve_output_len=16,
        prefix=dict(num_seqs=8, system_len=256, question_len=16, output_len=8),
        long_prompt_len=768, long_running=2, long_running_output=24, chunk=128,
    ),
    ("gpu", False): Sizes(
        prefill_len=1024, decode_len=256, repeats=3, offline=dict(num_seqs=256), slow_stage_seqs=16,
        serve_requests={1: 8, 16: 64}, serve_prompt_len=(100, 1024), serve_output_len=256,
        prefix=dict(num_seqs=64, system_len=2048, question_len=64, output_len=32),
        long_prompt_len=16384, long_running=16, long_running_output=256, chunk=2048,
    ),
    ("gpu", True): Sizes(
        prefill_len=512, decode_len=64, repeats=2, offline=dict(num_seqs=64), slow_stage_seqs=4,
        serve_requests={1: 4, 16: 32}, serve_prompt_len=(100, 512), serve_output_len=64,
        prefix=dict(num_seqs=32, system_len=1024, question_len=32, output_len=16),
        long_prompt_len=8192, long_running=8, long_running_output=128, chunk=1024,
    ),
}


def offline_workload(gpu: bool, quick: bool, vocab_size: int) -> Workload:
    sizes = SIZES["gpu" if gpu else "cpu", quick]
    return offline_upstream(**sizes.offline) if gpu else offline_cpu(vocab_size, **sizes.offline)


def serve_workload(sizes: Sizes, vocab_size: int, num_seqs: int, seed: int) -> Workload:
    """Random token-id prompts. Give every run against one server its own seed: the radix cache keeps the prompts it
    has seen, so a repeated prompt would be served from the cache."""
    rng = random.Random(seed)
    prompts = [[rng.randint(100, vocab_size - 100) for _ in range(rng.randint(*sizes.serve_prompt_len))]
               for _ in range(num_seqs)]
    return Workload(f"serve-{num_seqs}", prompts, [sizes.serve_output_len] * num_seqs,
                    f"{num_seqs} reqs, prompt randint{sizes.serve_prompt_len}, {sizes.serve_output_len} output tokens")

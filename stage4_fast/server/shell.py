"""``--shell``: chat with the model in this terminal, through the same workers the HTTP server uses."""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Dict, List

from ..core import SamplingParams
from ..env import ENV
from .args import ServerArgs
from .frontend import BackendUnavailable, FrontendManager, RequestRejected
from .stream import generate_deltas

if TYPE_CHECKING:
    from .launch import WorkerSet

HELP = "/reset clears the conversation, /exit or Ctrl-D quits, Ctrl-C quits (also while the model is answering)"


def _shell_sampling_params(max_seq_len: int) -> SamplingParams:
    return SamplingParams(  # upstream's MINISGL_SHELL_* variables and defaults
        temperature=ENV.SHELL_TEMPERATURE.value,
        top_k=ENV.SHELL_TOP_K.value,
        top_p=ENV.SHELL_TOP_P.value,
        max_tokens=min(ENV.SHELL_MAX_TOKENS.value, max_seq_len),
    )


def run_shell(config: ServerArgs, info: dict, workers: WorkerSet) -> int:
    return asyncio.run(_shell(config, info, workers))


async def _shell(config: ServerArgs, info: dict, workers: WorkerSet) -> int:
    from prompt_toolkit import PromptSession

    loop = asyncio.get_running_loop()
    frontend = FrontendManager(config)
    died: List[str] = []

    def on_death(message: str) -> None:
        died.append(message)
        loop.call_soon_threadsafe(frontend.fail_all, message)

    workers.watch(on_death)
    params = _shell_sampling_params(info["max_seq_len"])
    history: List[Dict[str, str]] = []
    session: PromptSession[str] = PromptSession()
    print(f"mini-sglang shell — {config.served_model_name}\n{HELP}", flush=True)
    try:
        while not died:
            try:
                line = (await session.prompt_async("> ")).strip()
            except (EOFError, KeyboardInterrupt):
                break
            if not line:
                continue
            if line in ("/exit", "/quit"):
                break
            if line == "/reset":
                history.clear()
                print("(conversation cleared)", flush=True)
                continue
            history.append({"role": "user", "content": line})
            answer: List[str] = []
            try:
                async for delta in generate_deltas(frontend, list(history), params, []):
                    print(delta.text, end="", flush=True)
                    answer.append(delta.text)
            except (RequestRejected, BackendUnavailable) as e:
                history.pop()
                print(f"\n[error] {e}", flush=True)
                continue
            print(flush=True)
            history.append({"role": "assistant", "content": "".join(answer)})
    except asyncio.CancelledError:  # Ctrl-C while answering: the request was aborted on the way out
        print(flush=True)
    finally:
        frontend.shutdown()
    print("bye", flush=True)
    return 1 if died else 0

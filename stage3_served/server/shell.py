"""``--shell``: chat with the model in this terminal, through the same workers the HTTP server uses."""

from __future__ import annotations

import asyncio
import signal
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


async def _print_answer(frontend: FrontendManager, messages: List[Dict[str, str]], params: SamplingParams,
                        answer: List[str]) -> None:
    """Stream the model's reply to the terminal, collecting its pieces in `answer`."""
    async for delta in generate_deltas(frontend, messages, params, []):
        print(delta.text, end="", flush=True)
        answer.append(delta.text)


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
    # Ctrl-C quits, whenever it comes. At the prompt (raw mode) prompt_toolkit reads it as a key and raises
    # KeyboardInterrupt. Otherwise the terminal sends SIGINT, handled here rather than by asyncio.run's
    # cancel-the-main-task, which a prompt opening or closing could swallow (the shell then kept running). The
    # handler cancels the answer being streamed, or ends a prompt that is opening or closing, and leaves a flag the
    # loop checks.
    interrupted = asyncio.Event()
    streaming: List[asyncio.Task] = []

    def end_prompt() -> None:
        if interrupted.is_set() and session.app.is_running:
            try:
                session.app.exit(exception=KeyboardInterrupt())
            except Exception:  # the prompt is already returning a line: the loop sees the flag next
                pass

    def on_sigint() -> None:
        interrupted.set()
        for task in streaming:
            task.cancel()
        end_prompt()

    loop.add_signal_handler(signal.SIGINT, on_sigint)
    print(f"mini-sglang shell — {config.served_model_name}\n{HELP}", flush=True)
    try:
        while not died and not interrupted.is_set():
            try:
                # handle_sigint=False: prompt_toolkit would otherwise swap its own SIGINT handler in and out, and
                # removing it would remove ours
                line = (await session.prompt_async("> ", pre_run=end_prompt, handle_sigint=False)).strip()
            except (EOFError, KeyboardInterrupt):
                break
            if interrupted.is_set():
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
            streaming.append(asyncio.ensure_future(_print_answer(frontend, list(history), params, answer)))
            try:
                await streaming[0]
            except asyncio.CancelledError:  # Ctrl-C while answering: the request was aborted on the way out
                print(flush=True)
                break
            except (RequestRejected, BackendUnavailable) as e:
                history.pop()
                print(f"\n[error] {e}", flush=True)
                continue
            finally:
                streaming.clear()
            print(flush=True)
            history.append({"role": "assistant", "content": "".join(answer)})
    finally:
        loop.remove_signal_handler(signal.SIGINT)
        frontend.shutdown()
    print("bye", flush=True)
    return 1 if died else 0

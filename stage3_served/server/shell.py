"""``--shell``: chat with the model in this terminal, through the same workers the HTTP server uses."""

from __future__ import annotations

import asyncio
import contextlib
import signal
import sys
import termios  # the shell is POSIX-only (its SIGINT handling needs loop.add_signal_handler too)
from typing import TYPE_CHECKING, Dict, Iterator, List

from ..core import SamplingParams
from ..env import ENV
from .args import ServerArgs
from .frontend import BackendUnavailable, FrontendManager, RequestRejected
from .stream import generate_deltas

if TYPE_CHECKING:
    from prompt_toolkit.key_binding import KeyBindings, KeyPressEvent

    from .launch import WorkerSet

HELP = "Ctrl-C stops an answer; /reset clears the conversation; /exit, or Ctrl-C or Ctrl-D at an empty prompt, quits"


def _shell_sampling_params(max_seq_len: int) -> SamplingParams:
    # upstream's variables; our defaults answer briefly (env.py)
    return SamplingParams(temperature=ENV.SHELL_TEMPERATURE.value, top_k=ENV.SHELL_TOP_K.value,
                          top_p=ENV.SHELL_TOP_P.value, max_tokens=min(ENV.SHELL_MAX_TOKENS.value, max_seq_len))


async def _print_answer(frontend: FrontendManager, messages: List[Dict[str, str]], params: SamplingParams,
                        answer: List[str]) -> None:
    async for delta in generate_deltas(frontend, messages, params, []):
        print(delta.text, end="", flush=True)
        answer.append(delta.text)


@contextlib.contextmanager
def _keys_not_echoed() -> Iterator[None]:
    """Echo off while an answer streams: keys typed ahead wait for the next prompt; Ctrl-C still signals."""
    if not sys.stdin.isatty():
        yield
        return
    fd = sys.stdin.fileno()
    saved = termios.tcgetattr(fd)
    quiet = list(saved)
    quiet[3] &= ~termios.ECHO  # lflag
    termios.tcsetattr(fd, termios.TCSANOW, quiet)  # TCSANOW, not TCSAFLUSH: keep what was typed ahead
    try:
        yield
    finally:
        termios.tcsetattr(fd, termios.TCSANOW, saved)


def _prompt_key_bindings() -> KeyBindings:
    from prompt_toolkit.key_binding import KeyBindings  # lazily, like the session: the server never needs it

    bindings = KeyBindings()

    @bindings.add("c-c")
    def _(event: KeyPressEvent) -> None:
        """Ctrl-C at the prompt clears the line; at an empty prompt it quits (as Ctrl-D does)."""
        if event.app.current_buffer.text:
            event.app.current_buffer.reset()
        else:
            event.app.exit(exception=KeyboardInterrupt())

    return bindings


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
    session: PromptSession[str] = PromptSession(key_bindings=_prompt_key_bindings())
    # At the prompt prompt_toolkit reads Ctrl-C as a key; otherwise SIGINT cancels a streaming answer, or between
    # answers sets a flag the loop checks and ends a prompt that is opening.
    ctrl_c = asyncio.Event()
    streaming: List[asyncio.Task] = []

    def end_prompt() -> None:
        if ctrl_c.is_set() and session.app.is_running:
            with contextlib.suppress(Exception):  # the prompt is already returning a line: the loop sees the flag next
                session.app.exit(exception=KeyboardInterrupt())

    def on_sigint() -> None:
        if streaming:  # (an answer that has just ended swallows it: a late Ctrl-C does not quit the shell)
            streaming[0].cancel()
            return
        ctrl_c.set()
        end_prompt()

    loop.add_signal_handler(signal.SIGINT, on_sigint)
    print(f"mini-sglang shell — {config.served_model_name}\n{HELP}", flush=True)
    try:
        while not died:
            try:
                # handle_sigint=False: removing prompt_toolkit's own SIGINT handler would remove ours
                line = (await session.prompt_async("> ", pre_run=end_prompt, handle_sigint=False)).strip()
            except (EOFError, KeyboardInterrupt):
                break
            if ctrl_c.is_set():  # Ctrl-C after Enter, before the answer began: that answer is not started
                ctrl_c.clear()
                print("[stopped]", flush=True)
                continue
            if not line:
                continue
            if line in ("/exit", "/quit"):
                break
            if line == "/reset":
                history.clear()
                print("(conversation cleared)", flush=True)
                continue
            history.append({"role": "user", "content": line})
            await _turn(frontend, history, params, streaming)
    finally:
        loop.remove_signal_handler(signal.SIGINT)
        frontend.shutdown()
    print("bye", flush=True)
    return 1 if died else 0


async def _turn(frontend: FrontendManager, history: List[Dict[str, str]], params: SamplingParams,
                streaming: List[asyncio.Task]) -> None:
    """Answer the question that ends ``history``; stopped or refused, the question leaves the history."""
    answer: List[str] = []
    streaming.append(asyncio.ensure_future(_print_answer(frontend, list(history), params, answer)))
    try:
        with _keys_not_echoed():
            await streaming[0]
    except (asyncio.CancelledError, RequestRejected, BackendUnavailable) as e:  # Ctrl-C: the request was aborted
        history.pop()  # the question goes with its cut answer
        print("\n[stopped]" if isinstance(e, asyncio.CancelledError) else f"\n[error] {e}", flush=True)
        return
    finally:
        streaming.clear()
    print(flush=True)
    history.append({"role": "assistant", "content": "".join(answer)})

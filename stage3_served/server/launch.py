"""Start the worker processes, wait until each is ready, serve, and take everything down on the way out.

Processes: this one (API server or shell) -> tokenizer worker(s) -> scheduler rank 0 (-> ranks 1..tp-1) ->
detokenizer -> this one. With ``--num-tokenizer 0`` (default) one worker both tokenizes and detokenizes.

Lifecycle rules (upstream had none of them):
* ready means every worker acknowledged (the HTTP port opens only then);
* Ctrl-C / SIGTERM stop all workers: they ignore SIGINT (a terminal sends it to the whole process group; the
  parent alone decides), get SIGTERM, and are killed if they linger; workers also die with a SIGKILLed parent;
* a worker that dies brings the server down with a message naming it, instead of leaving clients hanging.
"""

from __future__ import annotations

import ctypes
import logging
import multiprocessing as mp
import multiprocessing.connection
import os
import queue
import signal
import socket
import sys
import threading
import time
from contextlib import suppress
from dataclasses import replace
from typing import Any, Callable, List

from ..distributed import DistributedInfo
from ..utils.process import setup_worker_process
from .args import ServerArgs, parse_args
from .cli import prog_name
from .preflight import StartupError, bind_listener, check_port_free

logger = logging.getLogger("stage3_served")

STOP_TIMEOUT_S = 10.0


class WorkerDied(RuntimeError):
    pass


def _worker_setup(parent_pid: int, log_level: str, role: str) -> None:
    if sys.platform.startswith("linux"):  # die with the parent
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # 1: PR_SET_PDEATHSIG
    if os.getppid() != parent_pid:  # the parent died before prctl took effect
        os._exit(1)
    setup_worker_process(role)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))  # unwinds through finally blocks, which close the sockets
    logging.basicConfig(level=log_level.upper(), format="[%(asctime)s %(processName)s] %(levelname)s %(message)s")


def _run_scheduler(config: ServerArgs, ack_queue: Any, parent_pid: int) -> None:
    _worker_setup(parent_pid, config.effective_log_level, f"scheduler_{config.tp_info.rank}")
    import torch

    from ..scheduler import Scheduler

    with torch.inference_mode():
        scheduler = Scheduler(config)
        try:
            scheduler.sync_all_ranks()
            if config.tp_info.is_primary():
                ack_queue.put({"name": "scheduler", **scheduler.backend_info()})
            scheduler.run_forever()
        except (KeyboardInterrupt, SystemExit):
            pass
        finally:
            scheduler.shutdown()


def _run_tokenizer(kwargs: dict, ack_queue: Any, parent_pid: int, log_level: str, role: str) -> None:
    _worker_setup(parent_pid, log_level, role)
    import torch

    torch.set_num_threads(1)  # leave the cores to the scheduler
    from ..tokenizer import tokenize_worker

    try:
        tokenize_worker(ack_queue=ack_queue, **kwargs)
    except (KeyboardInterrupt, SystemExit):
        pass


class WorkerSet:
    def __init__(self, config: ServerArgs) -> None:
        self.config = config
        self.ctx = mp.get_context("spawn")
        self.ack_queue = self.ctx.Queue()
        self.procs: List[mp.process.BaseProcess] = []
        self.stopping = False

    def start(self) -> None:
        c, pid = self.config, os.getpid()
        tp, level = c.tp_info.size, c.effective_log_level
        targets: list[tuple[str, Callable, tuple]] = []
        for rank in range(tp):
            rank_config = replace(c, tp_info=DistributedInfo(rank, tp))
            targets.append((f"minisgl-TP{rank}-scheduler", _run_scheduler, (rank_config, self.ack_queue, pid)))
        common = dict(tokenizer_path=c.model_path, backend_addr=c.zmq_backend_addr, frontend_addr=c.zmq_frontend_addr)
        detok = dict(common, addr=c.zmq_detokenizer_addr, create=c.share_tokenizer, local_bs=64,
                     tokenizer_id=c.num_tokenizer)
        role = "tokenizer+detokenizer" if c.share_tokenizer else "detokenizer"  # the process title
        targets.append(("minisgl-detokenizer-0", _run_tokenizer, (detok, self.ack_queue, pid, level, role)))
        for i, addr in enumerate([] if c.share_tokenizer else c.zmq_tokenizer_addrs):
            tok = dict(common, addr=addr, create=True, local_bs=64, tokenizer_id=i)
            args = (tok, self.ack_queue, pid, level, f"tokenizer_{i}")
            targets.append((f"minisgl-tokenizer-{i}", _run_tokenizer, args))
        # children inherit an ignored SIGINT through exec (spawn), so Ctrl-C never interrupts them half-way
        previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
        try:
            for name, target, args in targets:
                proc = self.ctx.Process(target=target, args=args, name=name, daemon=False)
                proc.start()
                self.procs.append(proc)
        finally:
            signal.signal(signal.SIGINT, previous)

    def _death_message(self, proc: mp.process.BaseProcess) -> str:
        code = proc.exitcode
        how = f"was killed by signal {-code}" if code is not None and code < 0 else f"exited with code {code}"
        return f"worker {proc.name} (pid {proc.pid}) {how}; shutting the server down"

    def wait_ready(self) -> dict:
        """Block until every worker acknowledged; returns what the scheduler reported."""
        expected = 1 + (1 if self.config.share_tokenizer else 1 + self.config.num_tokenizer)
        info: dict = {}
        while expected:
            try:
                ack = self.ack_queue.get(timeout=0.2)
            except queue.Empty:
                ack = None
            if ack is None:
                for proc in self.procs:
                    if not proc.is_alive():
                        raise WorkerDied(self._death_message(proc).replace("; shutting", " during start-up; shutting"))
                continue
            expected -= 1
            if ack.get("name") == "scheduler":
                info = ack
        return info

    def watch(self, on_death: Callable[[str], None]) -> None:
        """Call ``on_death(message)`` (from a thread) when a worker exits while we are not stopping."""

        def run() -> None:
            sentinels = {p.sentinel: p for p in self.procs}
            ready = mp.connection.wait(list(sentinels))
            if not self.stopping:
                proc = sentinels[ready[0]]
                proc.join(1.0)
                message = self._death_message(proc)
                logger.error(message)
                on_death(message)

        threading.Thread(target=run, name="worker-watchdog", daemon=True).start()

    def stop(self) -> None:
        self.stopping = True
        for proc in self.procs:
            if proc.is_alive():
                proc.terminate()  # SIGTERM
        # one deadline for them all: they stop side by side, so a slow one must not add its wait to the next's
        deadline = time.monotonic() + STOP_TIMEOUT_S
        for proc in self.procs:
            proc.join(max(0.0, deadline - time.monotonic()))
            if proc.is_alive():
                logger.warning("worker %s did not stop within %.0f s; killing it", proc.name, STOP_TIMEOUT_S)
                proc.kill()
                proc.join()
        for path in self.config.ipc_paths:
            with suppress(FileNotFoundError):
                os.unlink(path)
        self.ack_queue.close()


def _reserve_ports(config: ServerArgs, shell: bool) -> socket.socket | None:
    """Before any model loads: the HTTP port (bound now, served later) and the TP rendezvous port must be free."""
    try:
        if config.tp_info.size > 1:
            check_port_free("127.0.0.1", config.server_port + 1, "the TP ranks' rendezvous (--port + 1)")
        return None if shell else bind_listener(config.server_host, config.server_port)
    except StartupError as e:
        print(f"{prog_name()}: error: {e}", file=sys.stderr)
        sys.exit(2)


def launch_server(run_shell: bool = False, argv: List[str] | None = None,
                  announce: Callable[[ServerArgs], str] | None = None) -> None:
    config, shell = parse_args(sys.argv[1:] if argv is None else argv, run_shell)
    listener = _reserve_ports(config, shell)
    logging.basicConfig(level=config.effective_log_level.upper(), format="[%(asctime)s] %(levelname)s %(message)s")
    if announce is not None:
        print(announce(config), flush=True)
    # SIGTERM unwinds like Ctrl-C (KeyboardInterrupt), and Ctrl-C does even where the launcher inherited an ignored
    # SIGINT (a background job of a script), as it does in uvicorn's own handler
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    workers = WorkerSet(config)
    exit_code = 0
    try:
        workers.start()
        info = workers.wait_ready()
        if shell:
            from .shell import run_shell as run

            exit_code = run(config, info, workers)
        else:
            exit_code = run_api_server(config, info, workers, listener)
    except KeyboardInterrupt:
        pass
    except WorkerDied as e:
        logger.error("%s", e)
        exit_code = 1
    finally:
        # a second Ctrl-C must not cut the cleanup short
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        workers.stop()
    sys.exit(exit_code)


def run_api_server(config: ServerArgs, info: dict, workers: WorkerSet, listener: socket.socket) -> int:
    import uvicorn

    from .api_server import BackendInfo, create_app

    backend = BackendInfo(**{k: info[k] for k in ("max_seq_len", "num_pages", "page_size", "vocab_size")})
    app = create_app(config, backend)

    def end_requests(reason: str) -> None:
        """From any thread: every in-flight request ends with an error event, new ones get 503."""
        loop = getattr(app.state, "loop", None)
        frontend = getattr(app.state, "frontend", None)
        if loop is not None and frontend is not None:
            loop.call_soon_threadsafe(frontend.fail_all, reason)

    class Server(uvicorn.Server):
        def handle_exit(self, sig: int, frame: Any) -> None:
            # uvicorn would re-raise the signal inside the event loop, cutting the app's shutdown short
            if self.should_exit and sig == signal.SIGINT:
                self.force_exit = True
            self.should_exit = True
            end_requests("the server is shutting down")

    server = Server(uvicorn.Config(app, host=config.server_host, port=config.server_port,
                                   log_level=config.effective_log_level,
                                   timeout_graceful_shutdown=5, timeout_keep_alive=config.timeout_keep_alive))
    died: list[str] = []

    def on_death(message: str) -> None:
        died.append(message)
        end_requests(message)
        server.should_exit = True

    workers.watch(on_death)
    logger.info("all workers ready; serving %s on http://%s:%d", config.served_model_name, config.server_host,
                config.server_port)
    server.run(sockets=[listener])
    return 1 if died else 0  # the watchdog has logged which worker died

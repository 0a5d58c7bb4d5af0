"""Start the worker processes, wait until each is ready, serve, and take everything down on the way out.

Processes: this one -> tokenizer worker(s) -> scheduler ranks -> detokenizer -> this one. With
``--api-server-count N`` (N > 1) N API server processes serve the port and this one only watches.

Lifecycle (not upstream): ready means every worker acknowledged; Ctrl-C / SIGTERM stop all workers (they ignore
SIGINT, get SIGTERM, are killed if they linger, die with a SIGKILLed parent); a dead worker brings the server down
with a message naming it. With ``--nnodes N`` nodes other than 0 run only their ranks (``nodes.py``)."""

from __future__ import annotations

import asyncio
import ctypes
import logging
import multiprocessing as mp
import multiprocessing.connection
import os
import queue
import shutil
import signal
import socket
import sys
import tempfile
import threading
import time
from contextlib import suppress
from dataclasses import replace
from typing import Any, Callable, List, Tuple

from ..distributed import DistributedInfo
from ..utils.process import freeze_startup_heap, setup_worker_process
from .args import ServerArgs, parse_args, split_host_port
from .cli import prog_name
from .nodes import NodeLink
from .preflight import StartupError, bind_listener, check_port_free

logger = logging.getLogger("stage4_fast")

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
            info = scheduler.backend_info() if config.tp_info.is_primary() else {}
            freeze_startup_heap()  # before the ack: the first request must not wait for its collection
            ack_queue.put({"name": "scheduler", "rank": config.tp_info.rank, **info})
            scheduler.run_forever()
        except (KeyboardInterrupt, SystemExit):
            pass
        finally:
            try:
                scheduler.shutdown()  # its barrier fails at once when a rank is gone (another machine was lost)
            except RuntimeError as e:
                logger.warning("TP rank %d stopped without the other ranks: %s", config.tp_info.rank,
                               str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__)


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
        self.metrics_dir: str | None = None  # the API server processes' Prometheus files (start_api_servers)
        # set once every API server process acked: until then none answers, so a /health answer means all are up
        self.serving = self.ctx.Event()
        # the node link reports a lost machine through this pipe, which the watchdog waits on
        self._link_reader, self._link_writer = mp.Pipe(duplex=False)
        self.link = NodeLink(config.node_rank, config.nnodes, *config.node_link_addr, config.ranks_per_node,
                             join_timeout_s=config.distributed_timeout) if config.nnodes > 1 else None

    @property
    def serves(self) -> bool:
        return self.config.node_rank == 0

    def start(self) -> None:
        c, pid = self.config, os.getpid()
        tp, level = c.tp_info.size, c.effective_log_level
        if self.link is not None:
            self.link.start(self._link_writer.send)
        targets: list[tuple[str, Callable, tuple]] = []
        for rank in c.local_tp_ranks:
            rank_config = replace(c, tp_info=DistributedInfo(rank, tp))
            targets.append((f"minisgl-TP{rank}-scheduler", _run_scheduler, (rank_config, self.ack_queue, pid)))
        common = dict(tokenizer_path=c.model_path, backend_addr=c.zmq_backend_addr, frontend_addrs=c.zmq_frontend_addrs)
        detok = dict(common, addr=c.zmq_detokenizer_addr, create=c.share_tokenizer, local_bs=64,
                     tokenizer_id=c.num_tokenizer)
        role = "tokenizer+detokenizer" if c.share_tokenizer else "detokenizer"  # the process title
        if self.serves:
            targets.append(("minisgl-detokenizer-0", _run_tokenizer, (detok, self.ack_queue, pid, level, role)))
        for i, addr in enumerate([] if c.share_tokenizer or not self.serves else c.zmq_tokenizer_addrs):
            tok = dict(common, addr=addr, create=True, local_bs=64, tokenizer_id=i)
            args = (tok, self.ack_queue, pid, level, f"tokenizer_{i}")
            targets.append((f"minisgl-tokenizer-{i}", _run_tokenizer, args))
        self._spawn(targets)

    def _spawn(self, targets: list[tuple[str, Callable, tuple]]) -> None:
        # children inherit an ignored SIGINT through exec (spawn), so Ctrl-C never interrupts them half-way
        previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
        try:
            for name, target, args in targets:
                proc = self.ctx.Process(target=target, args=args, name=name, daemon=False)
                proc.start()
                self.procs.append(proc)
        finally:
            signal.signal(signal.SIGINT, previous)

    def start_api_servers(self, info: dict, listener: socket.socket) -> None:
        """Start the N API server processes and wait for them (process 0 takes ``listener``)."""
        c = self.config
        # the API server processes' sockets may bind the port too now; Linux spreads the connections over them
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        self.metrics_dir = tempfile.mkdtemp(prefix=f"minisgl_metrics{c._unique_suffix}.")  # (named as the ipc files)
        created = int(time.time())
        self._spawn([(f"minisgl-api-server-{i}", _run_api_server,
                      (c, info, i, listener if i == 0 else None, created, self.metrics_dir, self.ack_queue,
                       self.serving, os.getpid()))
                     for i in range(c.api_server_count)])
        self._wait_acks(c.api_server_count)

    def _death_message(self, proc: mp.process.BaseProcess) -> str:
        code = proc.exitcode
        how = f"was killed by signal {-code}" if code is not None and code < 0 else f"exited with code {code}"
        return f"worker {proc.name} (pid {proc.pid}) {how}; shutting the server down"

    def wait_ready(self) -> dict:
        """Block until every worker acknowledged; returns what the scheduler reported."""
        tokenizers = (1 if self.config.share_tokenizer else 1 + self.config.num_tokenizer) if self.serves else 0
        return self._wait_acks(len(self.config.local_tp_ranks) + tokenizers)

    def _wait_acks(self, expected: int) -> dict:
        info: dict = {}
        while expected:
            try:
                ack = self.ack_queue.get(timeout=0.2)
            except queue.Empty:
                ack = None
            if ack is None:
                if self._link_reader.poll():
                    raise WorkerDied(f"{self._link_reader.recv()}; stopping during start-up")
                for proc in self.procs:
                    if not proc.is_alive():
                        raise WorkerDied(self._death_message(proc).replace("; shutting", " during start-up; shutting"))
                continue
            expected -= 1
            if ack.get("name") == "scheduler" and ack["rank"] == 0:
                info = ack
        return info

    def watch(self, on_death: Callable[[str], None]) -> None:
        """Call ``on_death(message)`` (from a thread) when a worker exits or a machine is lost, unless stopping."""

        def run() -> None:
            sentinels = {p.sentinel: p for p in self.procs}
            ready = mp.connection.wait([*sentinels, self._link_reader])
            if self.stopping:
                return
            if self._link_reader in ready:
                message = f"{self._link_reader.recv()}; " + (
                    "shutting the server down" if self.serves else "stopping this node's ranks")
            else:
                proc = sentinels[ready[0]]
                proc.join(1.0)
                message = self._death_message(proc)
            logger.error(message)
            on_death(message)

        threading.Thread(target=run, name="worker-watchdog", daemon=True).start()

    def stop(self) -> None:
        self.stopping = True
        if self.link is not None:
            self.link.stop()  # the other machines stop too
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
        if self.metrics_dir is not None:
            shutil.rmtree(self.metrics_dir, ignore_errors=True)
        self.ack_queue.close()
        self._link_reader.close()
        self._link_writer.close()


def _reserve_ports(config: ServerArgs, shell: bool) -> socket.socket | None:
    """Before any model loads: the HTTP port (bound now, served later) and the TP rendezvous port must be free."""
    try:
        if config.dist_init_addr is not None:
            if config.node_rank == 0:  # node 0 binds PORT (+ PORT+1 and PORT+2 with several machines)
                host, port = split_host_port(config.dist_init_addr)
                uses = ["the TP ranks' rendezvous", "rank 0's step broadcast", "the machines' link"]
                for offset, what in enumerate(uses if config.nnodes > 1 else uses[:1]):
                    check_port_free(socket.gethostbyname(host), port + offset,
                                    f"{what} (--dist-init-addr port + {offset})", flag="--dist-init-addr port")
        elif config.tp_info.size > 1:
            check_port_free("127.0.0.1", config.server_port + 1, "the TP ranks' rendezvous (--port + 1)")
        return None if shell or config.node_rank > 0 else bind_listener(config.server_host, config.server_port)
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
        if not workers.serves:
            exit_code = run_rank_node(config, workers)
        elif shell:
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
    if workers.link is not None:
        # the node link's threads sit in a gloo receive that interpreter teardown can abort (SIGABRT): skip it
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(exit_code)
    sys.exit(exit_code)


def run_rank_node(config: ServerArgs, workers: WorkerSet) -> int:
    """A node other than 0: its ranks follow node 0's; wait until one of them exits or a machine is lost."""
    ended: queue.Queue[str] = queue.Queue()
    workers.watch(ended.put)
    ranks = config.local_tp_ranks
    logger.info("node %d of %d: TP ranks %d..%d of %d ready, following node 0 at %s", config.node_rank,
                config.nnodes, ranks[0], ranks[-1], config.tp_info.size, config.dist_init_addr)
    ended.get()  # Ctrl-C / SIGTERM interrupt the wait (KeyboardInterrupt)
    return 0 if workers.link is not None and workers.link.lost_cleanly else 1


def _http_server(config: ServerArgs, info: dict, api_index: int = 0, created: int | None = None,
                 on_ready: Callable[[], None] | None = None, serving: Any = None,
                 follow_launcher: bool = False) -> Tuple[Any, Callable[[str], None]]:
    """uvicorn with this process's app, and its ``end_requests(reason)``; sockets open once ``serving`` is set."""
    import uvicorn

    from .api_server import BackendInfo, create_app

    async def ready() -> None:
        if on_ready is not None:
            on_ready()
        while serving is not None and not await asyncio.to_thread(serving.wait, 0.1):
            if server.should_exit:
                return  # stopped before serving: uvicorn opens the sockets and shuts down at once

    backend = BackendInfo(**{k: info[k] for k in ("max_seq_len", "num_pages", "page_size", "vocab_size")})
    app = create_app(config, backend, api_index, created, ready)

    def end_requests(reason: str) -> None:
        """From any thread: every in-flight request ends with an error event, new ones get 503."""
        loop = getattr(app.state, "loop", None)
        frontend = getattr(app.state, "frontend", None)
        if loop is not None and frontend is not None:
            loop.call_soon_threadsafe(frontend.fail_all, reason)

    class Server(uvicorn.Server):
        def handle_exit(self, sig: int, frame: Any) -> None:
            # uvicorn would re-raise the signal inside the event loop, cutting the app's shutdown short
            if follow_launcher and sig == signal.SIGINT:
                return  # a terminal sends it to the whole process group; the launcher decides
            if self.should_exit and sig == signal.SIGINT:
                self.force_exit = True
            self.should_exit = True
            end_requests("the server is shutting down")

    server = Server(uvicorn.Config(app, host=config.server_host, port=config.server_port,
                                   log_level=config.http_log_level, access_log=config.access_log,
                                   timeout_graceful_shutdown=5, timeout_keep_alive=config.timeout_keep_alive))
    return server, end_requests


def run_api_server(config: ServerArgs, info: dict, workers: WorkerSet, listener: socket.socket) -> int:
    if config.api_server_count > 1:
        return _watch_api_servers(config, info, workers, listener)
    server, end_requests = _http_server(config, info)
    died: list[str] = []

    def on_death(message: str) -> None:
        died.append(message)
        end_requests(message)
        server.should_exit = True

    workers.watch(on_death)
    freeze_startup_heap()
    logger.info("all workers ready; serving %s on http://%s:%d", config.served_model_name, config.server_host,
                config.server_port)
    server.run(sockets=[listener])
    return 1 if died else 0  # the watchdog has logged which worker died


def _watch_api_servers(config: ServerArgs, info: dict, workers: WorkerSet, listener: socket.socket) -> int:
    """``--api-server-count N``: wait until a process exits or Ctrl-C / SIGTERM; ``launch_server`` stops them all."""
    workers.start_api_servers(info, listener)
    listener.close()  # API server 0 holds it now
    ended: queue.Queue[str] = queue.Queue()
    workers.watch(ended.put)
    logger.info("all workers ready; serving %s on http://%s:%d from %d API server processes",
                config.served_model_name, config.server_host, config.server_port, config.api_server_count)
    workers.serving.set()
    ended.get()  # Ctrl-C / SIGTERM interrupt the wait (KeyboardInterrupt)
    return 1


def _run_api_server(config: ServerArgs, info: dict, index: int, listener: socket.socket | None, created: int,
                    metrics_dir: str, ack_queue: Any, serving: Any, parent_pid: int) -> None:
    _worker_setup(parent_pid, config.effective_log_level, f"api_server_{index}")
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = metrics_dir  # before prometheus_client is imported (metrics.py)
    sock = listener if listener is not None else bind_listener(config.server_host, config.server_port, reuse_port=True)
    server, _ = _http_server(config, info, index, created, follow_launcher=True, serving=serving,
                             on_ready=lambda: ack_queue.put({"name": f"api_server_{index}"}))
    freeze_startup_heap()
    server.run(sockets=[sock])

"""One model over several machines: how the machines' launchers learn that another one is gone.

An idle server runs no collective, so the ranks would not notice a lost machine. The launchers form a gloo group
(store on node 0 at PORT+2); each posts a receive that completes only when a peer leaves: a word from one that stops
cleanly, an error from one that died; the survivor stops too. A machine that vanishes without closing its sockets is
left to the ranks' collective timeout."""

from __future__ import annotations

import threading
from contextlib import suppress
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Callable, List, Set

# the receives wait for as long as the server runs; torch needs some timeout, so it gets a long one
_FOREVER = timedelta(days=365)
_GOODBYE_TIMEOUT = timedelta(seconds=5)
_STOPPED = 1  # the one word a leaving peer sends


@dataclass
class NodeLink:
    node_rank: int
    nnodes: int
    host: str
    port: int
    ranks_per_node: int
    join_timeout_s: float = 60.0
    lost: str | None = None  # why the link ended (first loss only)
    lost_cleanly: bool = False  # the peer said it was stopping
    _stopping: bool = False
    _gone: Set[int] = field(default_factory=set)  # peers whose receive has ended: they take no word any more
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _joined: threading.Event = field(default_factory=threading.Event)

    @property
    def peers(self) -> List[int]:
        """Whom this node watches: node 0 every other node, the others node 0."""
        return list(range(1, self.nnodes)) if self.node_rank == 0 else [0]

    def describe(self, node: int) -> str:
        first = node * self.ranks_per_node
        return f"node {node} (TP ranks {first}..{first + self.ranks_per_node - 1})"

    def start(self, on_lost: Callable[[str], None]) -> None:
        """Join the group and watch the peers from threads; ``on_lost(message)`` once, unless ``stop`` came first."""
        threading.Thread(target=self._run, args=(on_lost,), name="node-link", daemon=True).start()

    def _run(self, on_lost: Callable[[str], None]) -> None:
        import torch.distributed as dist

        try:
            store = dist.TCPStore(self.host, self.port, is_master=self.node_rank == 0, wait_for_workers=False,
                                  timeout=timedelta(seconds=self.join_timeout_s))
            dist.init_process_group("gloo", store=dist.PrefixStore("minisgl-nodes", store), rank=self.node_rank,
                                    world_size=self.nnodes, timeout=_FOREVER)
        except Exception as e:  # whatever torch raised (timeout, refused, bad address): its message says why
            who = "the other nodes" if self.node_rank == 0 else "node 0 (is it running, with this --dist-init-addr?)"
            self._report(on_lost, f"no link to {who} at {self.host}:{self.port}: {_first_line(e)}", False)
            return
        self._joined.set()
        for peer in self.peers:
            threading.Thread(target=self._watch, args=(peer, on_lost), name=f"node-link-{peer}", daemon=True).start()

    def _watch(self, peer: int, on_lost: Callable[[str], None]) -> None:
        import torch
        import torch.distributed as dist

        word = torch.zeros(1, dtype=torch.int32)
        try:
            dist.recv(word, src=peer)
            message, cleanly = f"{self.describe(peer)} stopped", word.item() == _STOPPED
        except Exception as e:  # gloo: "Connection closed by peer"
            message, cleanly = f"lost {self.describe(peer)}: {_first_line(e)}", False
        self._gone.add(peer)
        self._report(on_lost, message, cleanly)

    def _report(self, on_lost: Callable[[str], None], message: str, cleanly: bool) -> None:
        with self._lock:
            if self._stopping or self.lost is not None:
                return
            self.lost, self.lost_cleanly = message, cleanly
        on_lost(message)

    def stop(self) -> None:
        """This node is stopping: tell the peers (who stop too), then ignore what they do."""
        with self._lock:
            self._stopping = True
        if not self._joined.is_set():
            return
        import torch
        import torch.distributed as dist

        for peer in set(self.peers) - self._gone:
            with suppress(Exception):  # a peer gone already (or that had its word) never takes it
                dist.isend(torch.full((1,), _STOPPED, dtype=torch.int32), dst=peer).wait(_GOODBYE_TIMEOUT)


def _first_line(e: BaseException) -> str:
    """The gist of a torch/gloo error: its first sentence, without gloo's "[file.cc:123] " prefix."""
    lines = str(e).strip().splitlines()
    line = lines[0] if lines else type(e).__name__
    line = line.split("] ", 1)[-1] if line.startswith("[") else line
    return line.split(". ", 1)[0].rstrip(".")

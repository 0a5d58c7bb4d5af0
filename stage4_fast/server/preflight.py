"""Start-up checks (not upstream), before the model loads: a mistake costs one line, not a load and a traceback.

The port is bound here and handed to uvicorn once the workers are ready, so nothing can take it in between."""

from __future__ import annotations

import socket
from pathlib import Path

from ..models import MODEL_REGISTRY
from ..utils.hf import ModelNotFoundError, cached_load_hf_config, resolve_model_path

TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "tokenizer_config.json")


class StartupError(Exception):
    pass


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0] if text else type(exc).__name__


def check_model(given: str | None, needs_weights: bool = True) -> str:
    """The directory `--model` names (a hub id is downloaded first), checked so that loading it can start."""
    try:
        path = resolve_model_path(given)
    except ModelNotFoundError as e:
        raise StartupError(str(e)) from None
    except Exception as e:  # the hub: no such repository, gated, network down half-way
        raise StartupError(f"cannot get the model {given!r}: {_first_line(e)}") from None
    try:
        config = cached_load_hf_config(path)
    except Exception as e:
        raise StartupError(f"{path}/config.json cannot be read: {_first_line(e)}") from None
    arch = (getattr(config, "architectures", None) or ["(none)"])[0]
    if arch not in MODEL_REGISTRY:
        supported = ", ".join(MODEL_REGISTRY.supported_names())
        raise StartupError(f"{path}: architecture {arch} is not supported (supported: {supported})")
    directory = Path(path)
    if not any((directory / name).is_file() for name in TOKENIZER_FILES):
        raise StartupError(f"{path} has no tokenizer ({', '.join(TOKENIZER_FILES)})")
    if needs_weights and not any(directory.glob("*.safetensors")):
        raise StartupError(f"{path} has no *.safetensors weights (--dummy-weight runs with random ones)")
    return path


def _address(host: str, port: int) -> tuple:
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as e:
        raise StartupError(f"--host {host}: {e.strerror}") from None
    return infos[0]


def bind_listener(host: str, port: int, reuse_port: bool = False) -> socket.socket:
    """A socket bound to (host, port), not yet listening; ``reuse_port``: share it with the other API servers."""
    family, kind, proto, _, addr = _address(host, port)
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn: a restart is not blocked by TIME_WAIT
    if reuse_port:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    try:
        sock.bind(addr)
    except OSError as e:
        sock.close()
        raise StartupError(f"cannot listen on {host}:{port}: {e.strerror} (is another server running there? "
                           "pick another --port)") from None
    return sock


def check_port_free(host: str, port: int, what: str, flag: str = "--port") -> None:
    """For a port someone else binds later (the TP ranks' rendezvous): free now, or a one-line error."""
    if not 1 <= port <= 65535:
        raise StartupError(f"{what} would be port {port}, which does not exist; pick a lower {flag}")
    family, kind, proto, _, addr = _address(host, port)
    with socket.socket(family, kind, proto) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the rendezvous store will
        try:
            sock.bind(addr)
        except OSError as e:
            raise StartupError(f"{what} needs port {port} on {host}: {e.strerror}; pick another {flag}") from None

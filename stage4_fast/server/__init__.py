from .args import ServerArgs, parse_args
from .launch import launch_server

__all__ = ["ServerArgs", "launch_server", "parse_args"]

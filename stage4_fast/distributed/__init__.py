from .group import find_free_port, init_process_group
from .impl import DistributedCommunicator, destroy_distributed
from .info import DistributedInfo, get_tp_info, reset_tp_info, set_tp_info, try_get_tp_info

__all__ = ["DistributedCommunicator", "DistributedInfo", "destroy_distributed", "find_free_port", "get_tp_info",
           "init_process_group", "reset_tp_info", "set_tp_info", "try_get_tp_info"]

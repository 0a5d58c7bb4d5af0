from .info import DistributedInfo, get_tp_info, set_tp_info, try_get_tp_info

__all__ = ["DistributedInfo", "get_tp_info", "set_tp_info", "try_get_tp_info"]

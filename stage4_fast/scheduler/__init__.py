from .config import SchedulerConfig
from .scheduler import ForwardData, ForwardInput, Scheduler

__all__ = ["ForwardData", "ForwardInput", "Scheduler", "SchedulerConfig"]

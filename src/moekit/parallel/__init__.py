"""Expert parallelism: dispatchers over torch.distributed."""

from .base import Dispatched, Dispatcher, LocalDispatcher

__all__ = ["Dispatched", "Dispatcher", "LocalDispatcher"]

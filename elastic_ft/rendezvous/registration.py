"""Entry point through which torchrun discovers the ``etcdft`` backend.

torch loads every ``torchrun.handlers`` entry point as
``registry.register(name, entry_point.load()())``: the entry point is a
zero-argument factory that returns the handler creator. Loading it imports
nothing but this module; the handler is imported when torchrun asks for one.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from torch.distributed.elastic.rendezvous import RendezvousHandler, RendezvousParameters


def create_etcdft_handler(params: RendezvousParameters) -> RendezvousHandler:
    """The handler torchrun's agent asks for, in the agent's process, before it starts any worker.

    Starts the agent's reaper first (:mod:`elastic_ft.runtime.reaper`): the workers
    it starts next, their monitor processes and data loader workers then die
    with the agent, even when it is SIGKILLed.
    """
    from elastic_ft.rendezvous.handler import EtcdftRendezvousHandler
    from elastic_ft.runtime.reaper import ensure_reaper

    handler = EtcdftRendezvousHandler.from_parameters(params)
    ensure_reaper()
    return handler


def etcdft_handler_factory() -> Callable[[RendezvousParameters], RendezvousHandler]:
    return create_etcdft_handler

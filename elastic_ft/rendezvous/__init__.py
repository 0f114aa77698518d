"""The ``etcdft`` rendezvous backend: torchrun's rendezvous on etcd v3 (node side).

* :mod:`.config`: ``--rdzv-conf`` settings, checked before any etcd traffic;
* :mod:`.model`: the rendezvous state as data, and its JSON codec;
* :mod:`.rules`: every decision, a pure function of the state;
* :mod:`.handler`: torch's ``RendezvousHandler``, carrying the decisions out;
* :mod:`.registration`: the ``torchrun.handlers`` entry point.

Names are imported on first use, so torchrun's entry point loads only what
it needs.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from elastic_ft.runtime.lazy import lazy_exports

__all__ = [
    "BACKEND_NAME",
    "CONF_KEYS",
    "EtcdftRendezvousHandler",
    "EtcdftSettings",
    "RendezvousConfigError",
    "make_settings",
]

__getattr__, __dir__ = lazy_exports(
    __name__,
    {
        "BACKEND_NAME": "elastic_ft.rendezvous.handler:BACKEND_NAME",
        "EtcdftRendezvousHandler": "elastic_ft.rendezvous.handler:EtcdftRendezvousHandler",
        "CONF_KEYS": "elastic_ft.rendezvous.config:CONF_KEYS",
        "EtcdftSettings": "elastic_ft.rendezvous.config:EtcdftSettings",
        "RendezvousConfigError": "elastic_ft.rendezvous.config:RendezvousConfigError",
        "make_settings": "elastic_ft.rendezvous.config:make_settings",
    },
    globals(),
)

if TYPE_CHECKING:
    from elastic_ft.rendezvous.config import CONF_KEYS, EtcdftSettings, RendezvousConfigError, make_settings
    from elastic_ft.rendezvous.handler import BACKEND_NAME, EtcdftRendezvousHandler

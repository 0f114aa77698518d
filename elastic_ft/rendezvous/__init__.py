"""The ``etcdft`` rendezvous backend: torchrun's rendezvous on etcd v3."""

from elastic_ft.rendezvous.config import CONF_KEYS, EtcdftSettings, RendezvousConfigError, make_settings
from elastic_ft.rendezvous.handler import BACKEND_NAME, EtcdftRendezvousHandler

__all__ = [
    "BACKEND_NAME",
    "CONF_KEYS",
    "EtcdftRendezvousHandler",
    "EtcdftSettings",
    "RendezvousConfigError",
    "make_settings",
]

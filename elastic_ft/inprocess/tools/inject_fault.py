"""NVIDIA inprocess 0.4.1's path of :mod:`elastic_ft.shared_utils.inject_fault` (deprecated, as in NVIDIA 0.6).

This name is that same module object: ``Fault``, ``register_fault`` and the
workload-exception event are shared by code importing either path.
"""

import sys

from elastic_ft.shared_utils import inject_fault

sys.modules[__name__] = inject_fault

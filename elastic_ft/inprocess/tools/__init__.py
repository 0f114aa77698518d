"""NVIDIA inprocess 0.4.1's ``inprocess.tools`` (deprecated): use :mod:`elastic_ft.shared_utils.inject_fault`.

NVIDIA moved fault injection to ``shared_utils`` in 0.6; both paths name
the same module here, so that code written for either version runs.
"""

import warnings

from elastic_ft.inprocess.tools import inject_fault

warnings.warn(
    "elastic_ft.inprocess.tools is deprecated: import elastic_ft.shared_utils.inject_fault "
    "(NVIDIA 0.6's nvidia_resiliency_ext.shared_utils.inject_fault)",
    DeprecationWarning,
    stacklevel=2,
)

__all__ = ["inject_fault"]

"""NVIDIA's module name for the Wrapper: ``from ....inprocess.wrap import Wrapper`` keeps working.

The Wrapper lives in :mod:`elastic_ft.inprocess.wrapper`.
"""

from elastic_ft.inprocess.wrapper import CallWrapper, Wrapper

__all__ = ["CallWrapper", "Wrapper"]

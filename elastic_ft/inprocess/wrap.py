"""NVIDIA's module name for the Wrapper: ``from ....inprocess.wrap import Wrapper`` keeps working.

The Wrapper lives in :mod:`elastic_ft.inprocess.wrapper`; this name is that
same module object, so that ``unittest.mock.patch("...inprocess.wrap.X")``
(NVIDIA's tests replace the chained health checks that way) changes what the
Wrapper uses.
"""

import sys

from elastic_ft.inprocess import wrapper

sys.modules[__name__] = wrapper

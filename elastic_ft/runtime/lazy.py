"""PEP 562 lazy exports: a package's public names, imported on first use.

So that ``import elastic_ft`` (which torchrun's entry point for the
rendezvous backend and every ``elastic-ft`` command go through) loads
neither torch nor the worker side, while ``elastic_ft.Wrapper`` still works.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from typing import Any


def lazy_exports(
    package: str, exports: Mapping[str, str], namespace: dict[str, Any]
) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """``__getattr__`` and ``__dir__`` for ``package``.

    ``exports`` maps a public name to ``"module"`` (the name is that module)
    or ``"module:attribute"``. A resolved name is cached in ``namespace``
    (the package's globals), so each is imported once.
    """

    def __getattr__(name: str) -> Any:
        target = exports.get(name)
        if target is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        module_name, _, attribute = target.partition(":")
        value: Any = importlib.import_module(module_name)
        if attribute:
            value = getattr(value, attribute)
        namespace[name] = value
        return value

    def __dir__() -> list[str]:
        return sorted(set(namespace) | set(exports))

    return __getattr__, __dir__

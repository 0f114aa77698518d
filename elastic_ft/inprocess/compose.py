"""Chain callables into one, as NVIDIA's ``inprocess.Compose`` does.

``Compose(a, b, c)(x)`` is ``a(b(c(x)))``: the last argument runs first, as in
mathematical composition. This reads naturally for policies: in
``Compose(ShiftRanks(), FilterCountGroupedByKey(...))`` the filter marks ranks
to drop, then ``ShiftRanks`` renumbers the survivors.

Arguments chain as NVIDIA's do: a part that returns a tuple passes its items
as the next part's arguments, a part that takes no arguments passes nothing
on, and a part that returns ``None`` for a real argument is warned about
(it most likely forgot to return the state it was given).

A composition is an instance of the nearest class its parts share (after
``object``): composing rank assignments gives a ``RankAssignment``, composing
two ``Foo`` gives a ``Foo``, so code that checks ``isinstance(policy,
RankAssignment)`` accepts it.
"""

from __future__ import annotations

import inspect
import threading
import types
import warnings
from collections.abc import Callable
from typing import Any

_compose_classes: dict[type, type] = {}
_compose_classes_lock = threading.Lock()


def find_common_ancestor(*instances: object) -> type:
    """The most derived class every one of ``instances`` is an instance of (``object`` at worst).

    Raises:
        ValueError: no instances given.
    """
    if not instances:
        raise ValueError("find_common_ancestor needs at least one instance, got none")
    # By real inheritance (the MRO), not isinstance: virtual registrations make isinstance(1, abc.ABC) true.
    for base in type(instances[0]).__mro__:
        if all(base in type(instance).__mro__ for instance in instances):
            return base
    return object


def _compose_class_for(base: type) -> type:
    """``Compose`` made a subclass of ``base`` (cached); plain ``Compose`` when ``base`` cannot be mixed in."""
    if base is object or issubclass(base, Compose):
        return base if issubclass(base, Compose) else Compose
    with _compose_classes_lock:
        cls = _compose_classes.get(base)
        if cls is None:
            try:
                cls = types.new_class(f"Compose[{base.__name__}]", (Compose, base))
            except TypeError:  # a builtin layout or a metaclass conflict: no such class can exist
                cls = Compose
            cls.__module__ = __name__
            _compose_classes[base] = cls
        return cls


def _takes_arguments(part: Callable[..., Any]) -> bool:
    if isinstance(part, Compose):  # as its first part to run does
        return part._takes_arguments[-1]
    try:
        return len(inspect.signature(part).parameters) > 0
    except (TypeError, ValueError):  # a builtin without a signature: assume it takes what it is given
        return True


class Compose:
    """Functional composition of callables, applied right to left.

    Args:
        *parts: callables; at least one.

    Example::

        policy = Compose(ShiftRanks(), FilterCountGroupedByKey(key, cond))
        ctx = policy(ctx)  # same as ShiftRanks()(FilterCountGroupedByKey(...)(ctx))
    """

    parts: tuple[Callable[..., Any], ...]

    def __new__(cls, *parts: Callable[..., Any]) -> Compose:
        instance_class = cls
        if cls is Compose and parts:
            instance_class = _compose_class_for(find_common_ancestor(*parts))
        return super().__new__(instance_class)

    def __init__(self, *parts: Callable[..., Any]) -> None:
        if not parts:
            raise ValueError("Compose needs at least one callable, got none")
        for index, part in enumerate(parts):
            if not callable(part):
                raise TypeError(f"Compose argument {index} must be callable, got {part!r}")
        self.parts = parts
        self._takes_arguments = tuple(_takes_arguments(part) for part in parts)

    def __call__(self, *args: Any) -> Any:
        result: Any = None
        for part, takes_arguments in zip(reversed(self.parts), reversed(self._takes_arguments), strict=True):
            result = part(*args)
            if result is None and args and args != (None,):
                warnings.warn(
                    f"Compose: {part!r} returned None for {args!r}; a part passes on what it returns", stacklevel=2
                )
            args = result if isinstance(result, tuple) or not takes_arguments else (result,)
            args = () if args is None else args
        return result

    @property
    def instances(self) -> tuple[Callable[..., Any], ...]:
        """NVIDIA's name for :attr:`parts`."""
        return self.parts

    def __repr__(self) -> str:
        return f"Compose({', '.join(map(repr, self.parts))})"

"""Chain small single-argument callables into one.

``Compose(a, b, c)(x)`` is ``a(b(c(x)))``: the last argument runs first, as in
mathematical composition. This reads naturally for policies: in
``Compose(ShiftRanks(), FilterCountGroupedByKey(...))`` the filter marks ranks
to drop, then ``ShiftRanks`` renumbers the survivors.

A composition keeps the kind of what it composes: composing rank assignments
gives an object that is itself a ``RankAssignment`` (an instance of the
nearest abstract base class the parts share), so code that checks
``isinstance(policy, RankAssignment)`` accepts it.
"""

from __future__ import annotations

import inspect
import threading
import types
from collections.abc import Callable
from typing import Any, Generic, TypeVar

T = TypeVar("T")

_compose_classes: dict[type, type] = {}
_compose_classes_lock = threading.Lock()


def _nearest_common_abstract_base(parts: tuple[Callable[..., Any], ...]) -> type | None:
    """The first abstract class in the first part's MRO that every part is an instance of.

    Only abstract classes qualify: a concrete class such as ``ShiftRanks``
    carries configuration a composition does not have, so claiming to be one
    would be a lie; an abstract interface such as ``RankAssignment`` is
    exactly what the composition provides.
    """
    for base in type(parts[0]).__mro__:
        if base is Compose or not inspect.isabstract(base):
            continue
        if all(isinstance(part, base) for part in parts):
            return base
    return None


def _compose_class_for(base: type) -> type:
    with _compose_classes_lock:
        cls = _compose_classes.get(base)
        if cls is None:
            cls = types.new_class(f"Compose[{base.__name__}]", (Compose, base))
            cls.__module__ = __name__
            _compose_classes[base] = cls
        return cls


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


class Compose(Generic[T]):
    """Functional composition of single-argument callables, applied right to left.

    Args:
        *parts: callables taking and returning the same kind of value; at
            least one.

    Example::

        policy = Compose(ShiftRanks(), FilterCountGroupedByKey(key, cond))
        ctx = policy(ctx)  # same as ShiftRanks()(FilterCountGroupedByKey(...)(ctx))
    """

    parts: tuple[Callable[[T], T], ...]

    def __new__(cls, *parts: Callable[[T], T]) -> Compose[T]:
        instance_class = cls
        if cls is Compose and parts:
            base = _nearest_common_abstract_base(parts)
            if base is not None:
                instance_class = _compose_class_for(base)
        return super().__new__(instance_class)

    def __init__(self, *parts: Callable[[T], T]) -> None:
        if not parts:
            raise ValueError("Compose needs at least one callable, got none")
        for index, part in enumerate(parts):
            if not callable(part):
                raise TypeError(f"Compose argument {index} must be callable, got {part!r}")
        self.parts = parts

    def __call__(self, value: T) -> T:
        for part in reversed(self.parts):
            value = part(value)
        return value

    def __repr__(self) -> str:
        return f"Compose({', '.join(map(repr, self.parts))})"

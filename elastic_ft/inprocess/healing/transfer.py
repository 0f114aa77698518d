"""Send a rank's training state to other ranks point to point, in chunks, with a checksum of every tensor.

The state is whatever ``state_dict()`` returned: nested dicts, lists and
tuples of tensors and JSON values (TorchFT's ``Manager`` state). A DTensor
travels as its local shard, and the header says which shard of which
layout the sender holds (:mod:`~elastic_ft.inprocess.healing.layout`), so
that a receiver can refuse one that is not its own. It is
split into a *skeleton* (its structure and non-tensor values, sent as JSON,
never pickled) and its tensors, which are streamed as raw bytes in chunks
of at most ``chunk_bytes``: no buffer ever holds the whole state, the
sender sends CPU tensors from their own memory, and the receiver receives
into the tensors it returns. A few chunks stay in flight while the
checksum (CRC-32C) of the previous one is computed on both sides.

Wire format, sender to each receiver, over a process group's ``send`` and
``recv`` (one message order per pair of ranks)::

    int64[1]          header length
    uint8[length]     header: JSON {format, step, skeleton, tensors: [{dtype, shape}], chunk_bytes, small_bytes,
                                    layout: the sender's ShardLayout or null}
    uint8[...]        the tensors of at most small_bytes, packed in order, in chunks of chunk_bytes
    uint8[...]        every larger tensor's bytes, in order, in chunks of chunk_bytes
    int64[1 + n]      trailer: n, then the CRC-32C of every tensor's bytes

and back, receiver to sender, ``int64[1]``: the trailer arrived (the sender
frees its group only then, so no connection closes under a message).

The receiver checks the header (it is untrusted input) before allocating
anything, and every tensor's checksum before it returns the state: a
state that arrived corrupt or incomplete is never handed to
``load_state_dict``. CUDA tensors are staged through host memory, tensor by
tensor, and received on the CPU (``load_state_dict`` copies them to the
model's devices).
"""

from __future__ import annotations

import collections
import json
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import google_crc32c
import torch

from elastic_ft.inprocess.exception import StateTransferError
from elastic_ft.inprocess.healing.layout import layout_of
from elastic_ft.inprocess.healing.plan import ShardLayout
from elastic_ft.untrusted import is_count, json_object

T = TypeVar("T")

FORMAT = 1
#: Default chunk: large enough to amortise a send, small enough to overlap the checksums with the transfer.
CHUNK_BYTES = 4 << 20
#: Chunks in flight per receiver.
WINDOW = 8
#: Tensors up to this size travel packed together (biases, norms, step counters): one message, not one each.
SMALL_BYTES = 256 << 10
#: A header longer than this is garbage, not a state's skeleton.
MAX_HEADER_BYTES = 1 << 30
_SCALARS = (str, int, float, bool, type(None))


def _dtype(name: object) -> torch.dtype:
    value = getattr(torch, name, None) if isinstance(name, str) and name.isidentifier() else None
    if not isinstance(value, torch.dtype):
        raise StateTransferError(f"the header names an unknown tensor dtype {name!r}")
    return value


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


# ---- structure ----


def flatten_state(state: object) -> tuple[object, list[torch.Tensor], list[str]]:
    """``state`` as a JSON skeleton, its tensors in skeleton order, and each tensor's path (for errors).

    Raises:
        TypeError: a value is neither a tensor nor JSON data; names its path.
    """
    tensors: list[torch.Tensor] = []
    paths: list[str] = []

    def encode(value: object, path: str) -> object:
        if isinstance(value, torch.Tensor):
            local = value.to_local() if hasattr(value, "device_mesh") else value  # type: ignore[attr-defined]
            if local.layout is not torch.strided or local.is_quantized or local.is_meta:
                raise TypeError(f"state{path}: only dense tensors are transferred, got a {local.layout} tensor")
            tensors.append(local.detach())
            paths.append(path)
            return {"tensor": len(tensors) - 1}
        if isinstance(value, _SCALARS):
            return value
        if isinstance(value, dict):
            items = []
            for key, item in value.items():
                if not isinstance(key, _SCALARS):
                    raise TypeError(f"state{path}: keys are str, int, float, bool or None, got {type(key).__name__}")
                items.append([key, encode(item, f"{path}[{key!r}]")])
            node: dict[str, object] = {"dict": items}
            metadata = getattr(value, "_metadata", None)  # nn.Module.state_dict() carries module versions here
            if metadata is not None:
                node["metadata"] = encode(metadata, f"{path}._metadata")
            return node
        if isinstance(value, (list, tuple)):
            kind = "list" if isinstance(value, list) else "tuple"
            return {kind: [encode(item, f"{path}[{index}]") for index, item in enumerate(value)]}
        raise TypeError(
            f"state{path}: a {type(value).__name__} is neither a tensor nor JSON data "
            "(dict, list, tuple, str, int, float, bool, None)"
        )

    return encode(state, ""), tensors, paths


def unflatten_state(skeleton: object, tensors: Sequence[torch.Tensor]) -> object:
    """The inverse of :func:`flatten_state`; a malformed skeleton raises :class:`StateTransferError`."""
    return _unflatten(skeleton, tensors)[0]


def _unflatten(skeleton: object, tensors: Sequence[torch.Tensor]) -> tuple[object, list[str]]:
    """The state, and the path of every tensor by index; each tensor must be placed exactly once."""
    paths: dict[int, str] = {}

    def decode(node: object, path: str) -> object:
        if isinstance(node, _SCALARS):
            return node
        if isinstance(node, dict):
            if "tensor" in node:
                index = node["tensor"]
                if not is_count(index) or index >= len(tensors) or index in paths:
                    raise StateTransferError(f"state{path}: the skeleton names tensor {index!r} of {len(tensors)}")
                paths[index] = path
                return tensors[index]
            if "dict" in node and isinstance(node["dict"], list):
                decoded: dict[object, object] = collections.OrderedDict()
                for item in node["dict"]:
                    if not (isinstance(item, list) and len(item) == 2 and isinstance(item[0], _SCALARS)):
                        raise StateTransferError(f"state{path}: malformed dict item {item!r:.80}")
                    decoded[item[0]] = decode(item[1], f"{path}[{item[0]!r}]")
                if "metadata" in node:
                    # The attribute torch hangs a state dict's version metadata on; no stub declares it.
                    decoded._metadata = decode(node["metadata"], f"{path}._metadata")  # type: ignore[attr-defined]
                    return decoded
                return dict(decoded)
            if "list" in node and isinstance(node["list"], list):
                return [decode(item, f"{path}[{index}]") for index, item in enumerate(node["list"])]
            if "tuple" in node and isinstance(node["tuple"], list):
                return tuple(decode(item, f"{path}[{index}]") for index, item in enumerate(node["tuple"]))
        raise StateTransferError(f"state{path}: malformed skeleton node {node!r:.80}")

    state = decode(skeleton, "")
    if len(paths) != len(tensors):
        raise StateTransferError(f"the skeleton places {len(paths)} of the {len(tensors)} tensors sent")
    return state, [paths[index] for index in range(len(tensors))]


@dataclass(frozen=True)
class TensorSpec:
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        count = 1
        for size in self.shape:
            count *= size
        return count * self.dtype.itemsize


@dataclass(frozen=True)
class Header:
    step: int
    skeleton: object
    tensors: tuple[TensorSpec, ...]
    chunk_bytes: int
    small_bytes: int = SMALL_BYTES
    #: Which shard of which DTensor layout the state is; None when it holds no DTensor.
    layout: ShardLayout | None = None

    def packed(self) -> list[int]:
        """The tensors sent packed, in order, ahead of the others."""
        return [index for index, spec in enumerate(self.tensors) if spec.nbytes <= self.small_bytes]

    def streamed(self) -> list[int]:
        """The tensors sent one by one, in chunks, after the packed ones."""
        return [index for index, spec in enumerate(self.tensors) if spec.nbytes > self.small_bytes]

    def to_bytes(self) -> bytes:
        specs = [{"dtype": _dtype_name(s.dtype), "shape": list(s.shape)} for s in self.tensors]
        document = {
            "format": FORMAT,
            "step": self.step,
            "skeleton": self.skeleton,
            "tensors": specs,
            "chunk_bytes": self.chunk_bytes,
            "small_bytes": self.small_bytes,
            "layout": None if self.layout is None else self.layout.to_json(),
        }
        return json.dumps(document, separators=(",", ":")).encode()

    @classmethod
    def from_bytes(cls, data: bytes) -> Header:
        """Decode and check a header (untrusted): every field of the right type and range."""
        document = json_object(data)
        if document is None:
            raise StateTransferError(f"the state's header is not JSON: {data[:80]!r}")
        if document.get("format") != FORMAT:
            raise StateTransferError(f"expected a state header of format {FORMAT}, got {str(document)[:80]!r}")
        step, chunk, specs = document.get("step"), document.get("chunk_bytes"), document.get("tensors")
        small = document.get("small_bytes")
        if not is_count(small):
            raise StateTransferError(f"the header's small_bytes is {small!r}, expected an integer >= 0")
        if not is_count(step):
            raise StateTransferError(f"the header's step is {step!r}, expected an integer >= 0")
        if not is_count(chunk) or chunk == 0:
            raise StateTransferError(f"the header's chunk_bytes is {chunk!r}, expected an integer > 0")
        if not isinstance(specs, list):
            raise StateTransferError(f"the header's tensors are {specs!r:.80}, expected a list")
        tensors = []
        for spec in specs:
            shape = spec.get("shape") if isinstance(spec, dict) else None
            if not isinstance(shape, list) or not all(is_count(size) for size in shape):
                raise StateTransferError(f"malformed tensor spec {spec!r:.80}: expected a shape of integers >= 0")
            tensors.append(TensorSpec(_dtype(spec.get("dtype")), tuple(shape)))
        layout = document.get("layout")
        try:
            decoded = None if layout is None else ShardLayout.from_json(layout)
        except (TypeError, ValueError) as error:
            raise StateTransferError(f"the header's layout is malformed: {error}") from None
        return cls(step, document.get("skeleton"), tuple(tensors), chunk, small, decoded)


def _chunks(size: int, chunk_bytes: int) -> Iterator[slice]:
    for start in range(0, size, chunk_bytes):
        yield slice(start, min(size, start + chunk_bytes))


def _host_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes as a flat uint8 CPU tensor: a view where it is already contiguous on the CPU."""
    host = tensor.cpu() if tensor.device.type != "cpu" else tensor
    return host.contiguous().reshape(-1).view(torch.uint8)


def _crc(data: torch.Tensor, value: int) -> int:
    """CRC-32C (Castagnoli), hardware-accelerated where the CPU has it: several GB/s, so the check costs
    the transfer little."""
    return google_crc32c.extend(value, data.numpy()) if data.numel() else value


# ---- sending and receiving ----


class _Pipeline:
    """Operations in flight on a process group, at most ``limit``: posting one more waits for the oldest."""

    def __init__(self, limit: int) -> None:
        self._limit = limit
        self._works: collections.deque[tuple[Any, Callable[[], None] | None, object]] = collections.deque()

    def post(self, work: Any, then: Callable[[], None] | None = None, keep: object = None) -> None:
        """Track ``work``; ``then`` runs once it is done; ``keep`` (its buffer) lives until then."""
        self._works.append((work, then, keep))
        while len(self._works) > self._limit:
            self._finish_oldest()

    def drain(self) -> None:
        while self._works:
            self._finish_oldest()

    def _finish_oldest(self) -> None:
        work, then, _ = self._works.popleft()
        try:
            work.wait()  # within the group's timeout
        except RuntimeError as error:
            raise StateTransferError(f"the state transfer failed: {error}") from error
        if then is not None:
            then()


def run_interruptibly(task: Callable[[], T], name: str, abandon: Callable[[], None] | None = None) -> T:
    """``task()`` in a helper thread, while this thread waits in Python; returns or raises what it did.

    A transfer blocks in gloo's C code, where a restart's exception cannot
    reach a thread, and gloo can miss a peer's closed connection when an
    operation is posted as it closes (it then waits for the group's whole
    timeout). Waiting here, in short slices, the calling thread gets the
    restart at once; the helper thread is left to end with its group's
    timeout, or sooner through ``abandon``, called when the wait here ends
    with an exception (a restart): it makes ``task`` give up.
    """
    outcome: list[tuple[bool, Any]] = []
    done = threading.Event()

    def run() -> None:
        try:
            outcome.append((True, task()))
        except BaseException as error:  # noqa: BLE001 - handed to the waiting thread
            outcome.append((False, error))
        finally:
            done.set()

    threading.Thread(target=run, name=name, daemon=True).start()
    try:
        while not done.wait(0.005):
            pass
    except BaseException:
        if abandon is not None:
            abandon()
        raise
    succeeded, value = outcome[0]
    if not succeeded:
        raise value
    return value


def send_state(
    group: Any,
    receivers: Sequence[int],
    state: object,
    step: int,
    chunk_bytes: int = CHUNK_BYTES,
) -> int:
    """Send ``state`` (at optimizer step ``step``) to every group rank in ``receivers``; returns the bytes sent to each.

    Raises:
        TypeError: ``state`` holds a value that cannot be transferred, or DTensors whose layout cannot be told
            (before anything is sent).
        StateTransferError: a send failed or timed out (the group's timeout bounds every operation).
    """
    if chunk_bytes <= 0:
        raise ValueError(f"chunk_bytes must be > 0, got {chunk_bytes}")
    try:
        layout = layout_of(state)
    except ValueError as error:
        raise TypeError(str(error)) from None
    skeleton, tensors, _ = flatten_state(state)
    specs = tuple(TensorSpec(t.dtype, tuple(t.shape)) for t in tensors)
    header = Header(step, skeleton, specs, chunk_bytes, layout=layout).to_bytes()
    header_tensor = torch.frombuffer(bytearray(header), dtype=torch.uint8)
    pipeline = _Pipeline(WINDOW * len(receivers))

    def to_all(data: torch.Tensor) -> None:
        for receiver in receivers:
            pipeline.post(group.send([data], receiver, 0), keep=data)

    to_all(torch.tensor([len(header)], dtype=torch.int64))
    to_all(header_tensor)
    plan = Header(step, None, specs, chunk_bytes)
    checksums = [0] * len(tensors)
    packed = [_host_bytes(tensors[index]) for index in plan.packed()]
    if packed:
        bundle = torch.cat(packed)
        for part in _chunks(bundle.numel(), chunk_bytes):
            to_all(bundle[part])
        for index, data in zip(plan.packed(), packed, strict=True):
            checksums[index] = _crc(data, 0)
    for index in plan.streamed():
        data, crc = _host_bytes(tensors[index]), 0
        for part in _chunks(data.numel(), chunk_bytes):
            chunk = data[part]
            to_all(chunk)
            crc = _crc(chunk, crc)  # while the chunk is on its way (both only read it)
        checksums[index] = crc
    to_all(torch.tensor([len(checksums), *checksums], dtype=torch.int64))
    acks = [torch.zeros(1, dtype=torch.int64) for _ in receivers]
    for receiver, ack in zip(receivers, acks, strict=True):
        pipeline.post(group.recv([ack], receiver, 0), keep=ack)
    pipeline.drain()
    return sum(spec.nbytes for spec in specs) + len(header)


@dataclass(frozen=True)
class Received:
    state: object
    #: The optimizer step the sender's state had taken.
    step: int
    #: Bytes received: the tensors' and the header's.
    nbytes: int
    #: Which shard of which DTensor layout the sender's state was; None when it held no DTensor.
    layout: ShardLayout | None = None


def receive_state(group: Any, sender: int) -> Received:
    """Receive a state from group rank ``sender``, every tensor's checksum checked.

    Raises:
        StateTransferError: a receive failed or timed out, the header is
            malformed, or a tensor's checksum does not match (names its path).
    """
    single = _Pipeline(0)
    length = torch.zeros(1, dtype=torch.int64)
    single.post(group.recv([length], sender, 0))
    if not 0 < int(length) <= MAX_HEADER_BYTES:
        raise StateTransferError(f"the state's header length is {int(length)}, expected 1 to {MAX_HEADER_BYTES}")
    header_tensor = torch.empty(int(length), dtype=torch.uint8)
    single.post(group.recv([header_tensor], sender, 0))
    header = Header.from_bytes(header_tensor.numpy().tobytes())
    try:
        tensors = [torch.empty(spec.shape, dtype=spec.dtype) for spec in header.tensors]
    except RuntimeError as error:  # an absurd shape in the header
        raise StateTransferError(f"cannot allocate the state's tensors: {error}") from None
    checksums = [0] * len(tensors)
    pipeline = _Pipeline(WINDOW)
    packed = header.packed()
    bundle = torch.empty(sum(header.tensors[index].nbytes for index in packed), dtype=torch.uint8)

    def unpack() -> None:
        offset = 0
        for index in packed:
            size = header.tensors[index].nbytes
            data = bundle[offset : offset + size]
            tensors[index].reshape(-1).view(torch.uint8).copy_(data)
            checksums[index] = _crc(data, 0)
            offset += size

    parts = list(_chunks(bundle.numel(), header.chunk_bytes))
    for number, part in enumerate(parts):
        pipeline.post(group.recv([bundle[part]], sender, 0), unpack if number == len(parts) - 1 else None)
    if not parts:
        unpack()  # only empty tensors, or none
    for index in header.streamed():
        data = tensors[index].reshape(-1).view(torch.uint8)
        for part in _chunks(data.numel(), header.chunk_bytes):
            chunk = data[part]

            def check(chunk: torch.Tensor = chunk, index: int = index) -> None:
                checksums[index] = _crc(chunk, checksums[index])

            pipeline.post(group.recv([chunk], sender, 0), check)
    pipeline.drain()
    trailer = torch.zeros(len(tensors) + 1, dtype=torch.int64)
    single.post(group.recv([trailer], sender, 0))
    single.post(group.send([torch.ones(1, dtype=torch.int64)], sender, 0))
    count, *expected = trailer.tolist()
    if count != len(tensors):
        raise StateTransferError(f"the trailer lists {count} checksums for {len(tensors)} tensors")
    state, paths = _unflatten(header.skeleton, tensors)
    for path, got, want in zip(paths, checksums, expected, strict=True):
        if got != want:
            raise StateTransferError(f"state{path}: checksum {got:#010x} received, {want:#010x} sent")
    return Received(state, header.step, sum(spec.nbytes for spec in header.tensors) + int(length), header.layout)

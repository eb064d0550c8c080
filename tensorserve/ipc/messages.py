"""Messages between the server and a model's worker process.

One message on a stream socket (a ``socketpair``, never a network socket):

    u32 little-endian   length of the header
    header              msgpack map; its "tensors" entry lists
                        [name, dtype, shape] of each tensor that follows
                        ([name, "bytes", shape, size] for a bytes tensor;
                        [name, dtype, shape past axis 0, [axis 0 of each]]
                        for a run of tensors read back in order)
    tensor bytes        each tensor's raw bytes, in that order, back to back

Tensors travel as raw bytes (no pickle, no copy into the header) and are
read into one buffer per message, of which the received arrays are
zero-copy views. bfloat16 travels as its uint16 bit patterns, as on the wire
(see ``tensorserve.tensors.dtypes``). A bytes tensor (a numpy object array)
travels in the 4-byte-length framing of ``tensors.bytes_tensor``, its size
in the header, and is rebuilt as an object array of ``bytes``.
"""

from __future__ import annotations

import functools
import math
import socket
import struct
from collections.abc import Mapping, Sequence
from typing import Any, cast

import msgpack
import numpy as np

from tensorserve.tensors.bytes_tensor import frame, unframe
from tensorserve.tensors.dtypes import dtype

_LENGTH = struct.Struct("<I")
# Both ends are ours, but a corrupted stream must not make us allocate
# without bound. Above any request a client may send (max_request_bytes,
# 64 MiB by default): a request's parameters travel in a front end's header.
MAX_HEADER_BYTES = 1 << 30

Message = tuple[dict[str, Any], dict[str, np.ndarray]]
# A message of a stream of many (``StreamReader``): its tensors in the order
# they were sent, unnamed. Both ends of such a stream send them in order
# (``frames_in_order``), and a name each cost its reader more than its array.
InOrder = tuple[dict[str, Any], list[np.ndarray]]
# What a message is written as: header bytes, then each tensor's bytes.
Buffer = bytes | memoryview

# The exit code of a worker whose CUDA context a sticky CUDA error lost: it
# can run nothing on CUDA again, so it exits and the server replaces it. Its
# batch counts as one that crashed its worker, so recovery pins the failure on
# the items that cause it (batching/recovery.py).
EXIT_DEVICE_LOST = 70


def frames(
    header: Mapping[str, Any], tensors: Mapping[str, np.ndarray] | None = None
) -> list[Buffer]:
    """One message as the buffers to write, in order: the length and header,
    then each tensor's bytes: the array itself (any buffer-protocol consumer
    takes a C-contiguous array as its raw bytes; no copy, and no memoryview
    to build per tensor, which a reply of many rows pays once a row)."""
    payloads: list[Buffer] = []
    specs = [_announce(name, array, payloads) for name, array in (tensors or {}).items()]
    head = msgpack.packb({**header, "tensors": specs})
    return [_LENGTH.pack(len(head)) + head, *payloads]


def frames_in_order(header: Mapping[str, Any], arrays: Sequence[np.ndarray]) -> list[Buffer]:
    """``frames`` for arrays read back in order (named "0", "1", ...), as
    the front ends and the scheduler process exchange them: consecutive
    arrays of one dtype and one shape past their first axis are announced
    as one run, ``[key, dtype, rest of the shape, [first axis of each]]``.
    The bytes are the same; the receiver reads a run with one
    ``frombuffer`` and a slice per array, not a spec and a ``frombuffer``
    each (a message of many one-item requests announces two tensors a
    request, a reply of many rows one a row). This runs for every array
    the scheduler process sends or receives: an array that continues the
    run costs a shape comparison and two appends."""
    specs: list[list[Any]] = []
    payloads: list[Buffer] = []
    lengths: list[int] = []  # the first axis of each array of the run being announced
    run_dtype: np.dtype[Any] | None = None  # the run's (None: no run to continue)
    rest: tuple[int, ...] = ()  # its arrays' shape past axis 0
    for i, array in enumerate(arrays):
        dt, shape = array.dtype, array.shape
        if dt is run_dtype and shape and shape[1:] == rest:
            lengths.append(shape[0])
        elif dt.kind == "O" or not shape:  # bytes, or no axis to run along
            run_dtype = None
            specs.append(_announce(str(i), array, payloads))
            continue
        else:
            run_dtype, rest, lengths = dt, shape[1:], [shape[0]]
            specs.append([str(i), _name(dt), list(rest), lengths])
        if array.size:  # an ndarray is a buffer (numpy's stubs do not say so; no cast() call)
            whole = array if array.flags.c_contiguous else array.copy()
            payloads.append(whole)  # type: ignore[arg-type]
    head = msgpack.packb({**header, "tensors": specs})
    return [_LENGTH.pack(len(head)) + head, *payloads]


def _announce(name: str, array: np.ndarray, payloads: list[Buffer]) -> list[Any]:
    """One tensor's spec; its bytes appended to ``payloads``."""
    if array.dtype.kind == "O":  # bytes: never pickled, framed
        framed = frame(array)
        if len(framed):
            payloads.append(framed)
        return [name, "bytes", list(array.shape), len(framed)]
    if array.size:  # none to send: the shape says it all
        payloads.append(_contiguous(array))
    # bfloat16 arrays are uint16 here; the receiver's config says which
    # features are bfloat16, exactly as on the wire.
    return [name, _name(array.dtype), array.shape]


def _contiguous(array: np.ndarray) -> Buffer:
    # (not ascontiguousarray: it turns a 0-d array into a 1-d one)
    contiguous = array if array.flags.c_contiguous else array.copy()
    return cast(memoryview, contiguous)  # an ndarray is a buffer (numpy's stubs do not say so)


def send(
    sock: socket.socket, header: Mapping[str, Any], tensors: Mapping[str, np.ndarray] | None = None
) -> None:
    """Send ``header`` and the named host arrays (blocking: the worker's end)."""
    for buffer in frames(header, tensors):
        sock.sendall(buffer)


def recv(sock: socket.socket) -> Message:
    """The next message; ``EOFError`` if the other end has gone."""
    (length,) = _LENGTH.unpack(_read(sock, _LENGTH.size))
    header, sizes = _header(_read(sock, _checked(length)))
    return header, _arrays(header.pop("tensors"), sizes, _read(sock, sum(sizes)))


class MessageReader:
    """Reassembles one message from the reads an event loop's ``add_reader``
    callback makes: ``feed`` never blocks and never reads past the message."""

    def __init__(self) -> None:
        # Grows to each part's known size, then filled in place (recv_into).
        self._data = bytearray(_LENGTH.size)
        self._filled = 0
        self._header: dict[str, Any] | None = None
        self._sizes: list[int] = []

    def feed(self, sock: socket.socket) -> Message | None:
        """Read what the socket has; the message once it is complete.
        ``EOFError`` if the other end has gone."""
        while True:
            if self._filled < len(self._data):
                try:
                    received = sock.recv_into(
                        memoryview(self._data)[self._filled :], 0, socket.MSG_DONTWAIT
                    )
                except BlockingIOError:
                    return None
                if received == 0:
                    raise EOFError("the other end closed the connection")
                self._filled += received
            elif len(self._data) == _LENGTH.size:  # the length is in: the header next
                (length,) = _LENGTH.unpack(self._data)
                self._data.extend(bytes(_checked(length)))
            elif self._header is None:  # the header is in: the tensors next
                self._header, self._sizes = _header(self._data[_LENGTH.size :])
                self._data.extend(bytes(sum(self._sizes)))
            else:
                payload = memoryview(self._data)[len(self._data) - sum(self._sizes) :]
                return self._header, _arrays(self._header.pop("tensors"), self._sizes, payload)


class StreamReader:
    """Every complete message one read brings: for a socket that carries
    many small messages (a front end's), one ``recv`` for all of them
    instead of three per message. A message's tensors are copied out of the
    read buffer once (``MessageReader``, which reads a message straight into
    its own buffer, suits a worker's large batches better)."""

    CHUNK = 1 << 18

    def __init__(self) -> None:
        self._scratch = bytearray(self.CHUNK)
        self._pending = bytearray()
        self._head: tuple[dict[str, Any], list[int], int, int] | None = None
        self.drained = False  # the last read emptied the socket

    def feed(self, sock: socket.socket) -> list[InOrder] | None:
        """The messages completed by what the socket has now (None: nothing
        to read), each with its tensors in order; ``EOFError`` if the other
        end has gone."""
        try:
            received = sock.recv_into(self._scratch, self.CHUNK, socket.MSG_DONTWAIT)
        except BlockingIOError:
            return None
        if received == 0:
            raise EOFError("the other end closed the connection")
        # Less than a chunk: the socket was empty after this read (a reader
        # need not ask again to find out: its loop says when more comes).
        self.drained = received < self.CHUNK
        pending = self._pending
        pending += memoryview(self._scratch)[:received]
        done: list[InOrder] = []
        while True:
            if self._head is None:
                if len(pending) < _LENGTH.size:
                    break
                (length,) = _LENGTH.unpack_from(pending)
                start = _LENGTH.size + _checked(length)
                if len(pending) < start:
                    break
                # Released even if the header is corrupt: a view left exporting
                # ``pending`` would make every later read fail (it cannot grow).
                with memoryview(pending) as whole, whole[_LENGTH.size : start] as raw:
                    header, sizes = _header(raw)
                self._head = (header, sizes, start, start + sum(sizes))
            header, sizes, start, end = self._head
            if len(pending) < end:
                break
            payload = bytes(memoryview(pending)[start:end])
            done.append((header, _in_order(header.pop("tensors"), sizes, payload)))
            del pending[:end]
            self._head = None
        return done


def _checked(length: int) -> int:
    if length > MAX_HEADER_BYTES:
        raise ConnectionError(f"message header of {length} bytes: the stream is corrupt")
    return length


@functools.cache
def _name(dt: np.dtype[Any]) -> str:
    """A numpy dtype's name (numpy computes ``dtype.name`` in Python, each time)."""
    return dt.name


@functools.cache
def _numpy(name: str) -> tuple[np.dtype[Any], int]:
    """A wire dtype's numpy dtype and item size (looked up once per name:
    a message may announce hundreds of tensors)."""
    dt = dtype(name)
    return dt.numpy, dt.itemsize


def _header(raw: bytearray | memoryview) -> tuple[dict[str, Any], list[int]]:
    """The decoded header and the byte size of each tensor (or run) it
    announces. A negative size or axis would read the next message's bytes
    as this one's (the stream desynchronised for good): ``ConnectionError``."""
    header = msgpack.unpackb(raw)
    sizes = []
    for spec in header["tensors"]:
        shape = spec[2]
        if spec[1] == "bytes":
            size = spec[3]
        elif len(spec) == 4:  # a run: its first axes, then the shape they share
            lengths = spec[3]
            if lengths and min(lengths) < 0:
                raise ConnectionError(f"a run of tensors of negative length {lengths}")
            size = sum(lengths) * math.prod(shape) * _numpy(spec[1])[1]
        else:
            size = math.prod(shape) * _numpy(spec[1])[1]
        if size < 0 or (shape and min(shape) < 0):
            raise ConnectionError(f"tensor {spec[0]!r} of shape {shape}: the stream is corrupt")
        sizes.append(size)
    return header, sizes


def _arrays(specs: list[Any], sizes: list[int], payload: Any) -> dict[str, np.ndarray]:
    """``_in_order``'s arrays by name (a run's named on from its first's)."""
    names: list[str] = []
    for spec in specs:
        if len(spec) == 4 and spec[1] != "bytes":
            first = int(spec[0])
            names.extend(str(first + i) for i in range(len(spec[3])))
        else:
            names.append(spec[0])
    return dict(zip(names, _in_order(specs, sizes, payload)))


def _in_order(specs: list[Any], sizes: list[int], payload: Any) -> list[np.ndarray]:
    """Zero-copy views of ``payload``, one per announced tensor, in order
    (bytes tensors: object arrays rebuilt from their framing; a run: a view
    of each array). A front end's message announces a few tensors per
    request: this runs for each, so it counts from the sizes ``_header``
    already has rather than the shapes."""
    tensors: list[np.ndarray] = []
    offset = 0
    for spec, size in zip(specs, sizes):
        key, name, shape = spec[0], spec[1], spec[2]
        if name == "bytes":
            view = memoryview(payload)[offset : offset + size]
            tensors.append(unframe(view, shape, f"tensor {key!r}"))
        else:
            dt, itemsize = _numpy(name)
            flat = np.frombuffer(payload, dtype=dt, count=size // itemsize, offset=offset)
            if len(spec) == 4:
                block = flat.reshape(sum(spec[3]), *shape) if shape else flat
                at = 0
                for length in spec[3]:
                    tensors.append(block[at : at + length])
                    at += length
            else:
                # 1-D (a front end's token ids): already its shape, no reshape to pay for
                tensors.append(flat if len(shape) == 1 else flat.reshape(shape))
        offset += size
    return tensors


def _read(sock: socket.socket, size: int) -> bytearray:
    buffer = bytearray(size)
    view = memoryview(buffer)
    while view:
        received = sock.recv_into(view)
        if received == 0:
            raise EOFError("the other end closed the connection")
        view = view[received:]
    return buffer

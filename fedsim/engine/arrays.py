"""Flower ``Array`` values that stay NumPy arrays until something needs their bytes.

Flower's ``Array`` serialises at construction (``np.save`` into ``data``) and ``numpy()`` parses
the bytes again (``np.load``).  Across a process boundary that is the wire format; inside one
process (the local engine, or the reply an actor hands to Ray's own serialiser) it is pure
overhead paid twice per client and array: once when a client replies, once when the strategy
aggregates.  :class:`ResidentArray` keeps the array instead: ``numpy()`` returns a fresh copy (the
same contract as ``np.load``: the caller owns it), and ``data`` is produced on first access (Flower's
message layer, ``object_id``, a checkpoint), byte for byte what ``Array(ndarray)`` would hold, so a
strategy, Flower's runtime or a checkpoint cannot tell the two apart.
"""

from __future__ import annotations

from io import BytesIO
from typing import Any

import numpy as np
import torch
from flwr.app import Array, ArrayRecord
from flwr.common.constant import SType

_MAIN_FIELDS = ("dtype", "shape", "stype", "data")
_dtype_names: dict[np.dtype, str] = {}  # str(dtype) takes ~70 us in NumPy 2: once per dtype


def _dtype_name(dtype: np.dtype) -> str:
    name = _dtype_names.get(dtype)
    if name is None:
        name = _dtype_names[dtype] = str(dtype)
    return name


class ResidentArray(Array):
    """An ``Array`` holding its NumPy value; serialised lazily, exactly as ``Array(ndarray)``.

    Its ``__qualname__`` is ``"Array"``: Flower's object headers name the class, and a receiver must
    inflate it as a plain ``Array``.
    """

    __qualname__ = "Array"

    def __init__(self, ndarray: np.ndarray) -> None:  # noqa: D107  (Flower's __init__ would serialise now)
        self.__dict__.update(dtype=_dtype_name(ndarray.dtype), shape=tuple(ndarray.shape), stype=SType.NUMPY,
                             _ndarray=ndarray)

    def __getattr__(self, name: str) -> Any:
        # only reached when normal lookup fails: ``data`` before its first use
        if name == "data" and "_ndarray" in self.__dict__:
            buffer = BytesIO()
            np.save(buffer, self.__dict__["_ndarray"], allow_pickle=False)
            self.__dict__["data"] = buffer.getvalue()
            return self.__dict__["data"]
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    def __setattr__(self, name: str, value: Any) -> None:
        if name in _MAIN_FIELDS and "_ndarray" in self.__dict__:
            _ = self.data  # materialise the bytes, then behave as a plain Array from here on
            del self.__dict__["_ndarray"]
        super().__setattr__(name, value)

    def numpy(self) -> np.ndarray:
        ndarray = self.__dict__.get("_ndarray")
        return super().numpy() if ndarray is None else ndarray.copy()

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        # by function, not by class name (the class calls itself "Array"); pickles without the bytes
        ndarray = self.__dict__.get("_ndarray")
        if ndarray is not None:
            return _resident_array, (ndarray,)
        return _plain_array, (self.dtype, self.shape, self.stype, self.data)


def _resident_array(ndarray: np.ndarray) -> "ResidentArray":
    return ResidentArray(ndarray)


def _plain_array(dtype: str, shape: tuple[int, ...], stype: str, data: bytes) -> Array:
    return Array(dtype=dtype, shape=shape, stype=stype, data=data)


def ndarray_of(array: Array) -> np.ndarray:
    """An ``Array``'s NumPy value, read only: a :class:`ResidentArray`'s own array (no copy), else the parsed bytes."""
    value = array.__dict__.get("_ndarray")
    return array.numpy() if value is None else value


def host_arrays(state: dict[str, torch.Tensor], copy: bool = True) -> dict[str, np.ndarray]:
    """``state``'s tensors as host NumPy arrays (key order kept): copies, or (``copy=False``, for tensors the
    caller owns and will not write) the tensors' own memory; a CUDA tensor is always copied to the host."""
    if not all(type(k) is str for k in state):
        raise TypeError(f"ArrayRecord keys must be str, got {sorted({type(k).__name__ for k in state})}")
    arrays = ((k, _numpy(v)) for k, v in state.items())
    return {k: a.copy() if copy else a for k, a in arrays}


def _numpy(t: torch.Tensor) -> np.ndarray:
    """``t.detach().cpu().numpy()`` (the tensor's memory where it is on the host), without the two extra
    tensor objects for the common case: a CPU tensor that needs no grad."""
    try:
        return t.numpy()
    except (RuntimeError, TypeError):  # needs grad, on a device, or conjugated / negative view
        return t.detach().cpu().resolve_conj().resolve_neg().numpy()


def resident_record(state: dict[str, torch.Tensor], copy: bool = True) -> ArrayRecord:
    """An ``ArrayRecord`` of :class:`ResidentArray` copies of ``state``'s tensors (key order kept).

    ``copy=False``: the arrays share the tensors' memory, for tensors the caller owns and will not write
    (a learner's fresh reply copies, :attr:`~fedsim.contracts.learner.TrainResult.owned`); a CUDA tensor is
    still copied to the host.
    """
    return array_record(host_arrays(state, copy))


def array_record(arrays: dict[str, np.ndarray]) -> ArrayRecord:
    """An ``ArrayRecord`` of :class:`ResidentArray` values holding ``arrays`` themselves (no copy)."""
    record = ArrayRecord()  # ArrayRecord(dict) would copy into serialised Arrays
    # stored directly: every value is an Array and every key a str, what ArrayRecord.__setitem__ checks
    record.__dict__["_data"].update((k, ResidentArray(a)) for k, a in arrays.items())
    record.is_dirty = True
    return record


def resident_arrays(record: ArrayRecord) -> ArrayRecord:
    """``record`` with every serialised ``Array`` parsed once into a :class:`ResidentArray` (same values,
    key order kept).  A strategy returns the new global model serialised (``Array(ndarray)`` runs
    ``np.save``), and the server then reads it three times (the finiteness check, its evaluation and the
    next round's clients): each read of a plain ``Array`` parses the bytes again (``np.load``)."""
    if all("_ndarray" in a.__dict__ for a in record.values()):
        return record
    return array_record({k: ndarray_of(a) for k, a in record.items()})

"""What crosses from a worker, where the code under test runs, to the process that judges it.

A worker's reply was written in a process the code under test controlled: it may have replaced
any function of the harness there, the one that sends the reply included. Reading a reply must
therefore run nothing the reply names. multiprocessing's own transport is pickle, and unpickling
calls whatever callable the bytes name (a `__reduce__` returning `(os._exit, (0,))` ends the
reader with exit 0). So a reply crosses as plain data:

- torch.save of plain values only: tensors (plain ones, not subclasses), dtypes, sizes, devices,
  None, bool, int, float, str, bytes, and lists, tuples, sets and dicts of them;
- read back by torch.load(weights_only=True), which rebuilds nothing else (a reply that names any
  other global is refused: `TransferError`);
- the harness's own records (the dataclasses and enums an execution is made of: recorded calls,
  contract problems, the exception's record) travel as tagged dicts and are rebuilt here, only
  for the types named in RECORDS: fields set, no constructor, no code of the reply's choosing;
- a reply larger than the caller's bound is not read at all.

This module imports neither torch nor any other parity module at import time (parity.worker, which
parity.entry imports before torch, imports it).
"""

from __future__ import annotations

import dataclasses
import enum
import importlib
import io

RECORD, ENUM, FROZENSET = "__record__", "__enum__", "__frozenset__"

# The types a reply may hold beside plain values, by the name they cross under: what an execution
# of the code under test is made of (parity.runner.Execution's fields).
RECORDS = {
    "ScaledMMCall": ("parity.contract", "ScaledMMCall"),
    "CallData": ("parity.contract", "CallData"),
    "Scale": ("parity.contract", "Scale"),
    "TensorContract": ("parity.contract", "TensorContract"),
    "ContractProblem": ("parity.contract", "ContractProblem"),
    "Breach": ("parity.contract", "Breach"),
    "Raised": ("parity.rows", "Raised"),
    "Phase": ("parity.vocabulary", "Phase"),
}


class TransferError(ValueError):
    """A reply that is not plain data of the harness: unreadable, too large, or naming a type it may not."""


def _record_type(name: str) -> type:
    if name not in RECORDS:
        raise TransferError(f"the reply holds a record of type {name!r}, which no reply may hold")
    module, attribute = RECORDS[name]
    return getattr(importlib.import_module(module), attribute)


def to_plain(value):
    """`value` as plain data: records and enums of RECORDS tagged, tensors detached plain tensors."""
    import torch
    if isinstance(value, enum.Enum):  # before str and int: the harness's words are str enums
        _check_registered(type(value))
        return {ENUM: type(value).__name__, "value": value.value}
    if value is None or isinstance(value, (bool, int, float, str, bytes, torch.dtype, torch.device, torch.Size)):
        return value
    if isinstance(value, torch.Tensor):
        plain = value.detach()
        return plain if type(plain) is torch.Tensor else plain.as_subclass(torch.Tensor)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        _check_registered(type(value))
        return {RECORD: type(value).__name__,
                "fields": {f.name: to_plain(getattr(value, f.name)) for f in dataclasses.fields(value)}}
    if isinstance(value, frozenset):
        return {FROZENSET: [to_plain(item) for item in value]}
    if isinstance(value, (list, tuple, set)):
        return type(value)(to_plain(item) for item in value)
    if isinstance(value, dict):
        return {to_plain(key): to_plain(item) for key, item in value.items()}
    raise TypeError(f"{type(value).__name__} is not plain data a worker may send back")


def _check_registered(cls: type) -> None:
    if RECORDS.get(cls.__name__) != (cls.__module__, cls.__qualname__):
        raise TypeError(f"{cls.__module__}.{cls.__qualname__} is not a record a worker may send back "
                        f"(parity.transfer.RECORDS)")


def from_plain(value):
    """The inverse of to_plain, for the types of RECORDS only."""
    if isinstance(value, dict):
        if RECORD in value:
            cls = _record_type(value[RECORD])
            fields = value.get("fields")
            names = {f.name for f in dataclasses.fields(cls)}
            if not isinstance(fields, dict) or set(fields) != names:
                raise TransferError(f"a {value[RECORD]} record with fields {sorted(map(str, fields or ()))}, "
                                    f"not {sorted(names)}")
            record = object.__new__(cls)
            for name, item in fields.items():
                object.__setattr__(record, name, from_plain(item))
            return record
        if ENUM in value:
            cls = _record_type(value[ENUM])
            try:
                return cls(value.get("value"))
            except ValueError as err:
                raise TransferError(f"not a {value[ENUM]}: {err}") from None
        if FROZENSET in value:
            return frozenset(from_plain(item) for item in value[FROZENSET])
        return {from_plain(key): from_plain(item) for key, item in value.items()}
    if isinstance(value, (list, tuple, set)):
        return type(value)(from_plain(item) for item in value)
    return value


def encode(value) -> bytes:
    """The bytes of a reply (in the worker)."""
    import torch
    buffer = io.BytesIO()
    torch.save(to_plain(value), buffer)
    return buffer.getvalue()


def decode(data: bytes):
    """A reply read back (in the judging process): plain values and the records of RECORDS only."""
    import torch
    import pickle
    try:
        plain = torch.load(io.BytesIO(data), weights_only=True)
    except (pickle.UnpicklingError, RuntimeError, EOFError, ValueError, TypeError, AttributeError,
            ImportError, IndexError, KeyError, OverflowError, MemoryError) as err:
        lines = [line.strip() for line in str(err).splitlines() if line.strip()]
        said = next((line for line in lines if "Unsupported" in line), lines[0] if lines else "")
        raise TransferError(f"not plain data ({type(err).__name__}: {said[:200]})") from None
    return from_plain(plain)

"""Exceptions raised by the PTX toolkit.

Every error that concerns a place in a PTX text carries the 1-based line
number, so a user can jump to the offending statement.
"""
from __future__ import annotations


class PtxError(Exception):
    """Base class of all errors raised by :mod:`ptx`."""


class PtxParseError(PtxError):
    """The text is not PTX, or is malformed at ``line``."""

    def __init__(self, message: str, line: int) -> None:
        super().__init__(f"line {line}: {message}")
        self.message = message
        self.line = line


class PtxInstrumentError(PtxError):
    """A kernel cannot be instrumented (e.g. unknown entry name)."""

"""PTX analysis: parser, static read/write sets, instrumentation, cost features.

Pure Python (stdlib only); imports neither torch nor cupy. Entry points:
:func:`parse`, :func:`analyze`, :func:`report`, :func:`instrument`,
:func:`param_ranges`.
"""
from ptx.analysis import KernelAccess, ParamAccess, analyze, analyze_module
from ptx.errors import PtxError, PtxInstrumentError, PtxParseError
from ptx.instrument import Instrumented, SiteInfo, initial_slots, instrument
from ptx.parser import parse
from ptx.ranges import ParamRanges, decode_slots, param_ranges
from ptx.report import report

__all__ = [
    "KernelAccess", "ParamAccess", "analyze", "analyze_module", "PtxError", "PtxInstrumentError",
    "PtxParseError", "Instrumented", "SiteInfo", "initial_slots", "instrument", "parse",
    "ParamRanges", "decode_slots", "param_ranges", "report",
]

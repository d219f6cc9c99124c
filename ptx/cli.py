"""Command line: ``python -m ptx analyze FILE.ptx [--json]`` and
``python -m ptx instrument FILE.ptx -o OUT.ptx [--sites SITES.json]``.

Exit status 0 on success, 2 on a PTX error (message with line number on
stderr), 1 on an unreadable file.
"""
from __future__ import annotations

import argparse
import json
import sys

from ptx.errors import PtxError
from ptx.instrument import instrument
from ptx.report import format_table, report


def _read(path: str) -> str:
    if path == "-":
        return sys.stdin.read()
    with open(path, encoding="utf-8", errors="replace") as fh:
        return fh.read()


def main(argv: list[str] | None = None) -> int:
    """Run the CLI; returns the process exit status."""
    ap = argparse.ArgumentParser(prog="python -m ptx", description="PTX access analysis")
    sub = ap.add_subparsers(dest="cmd", required=True)
    a = sub.add_parser("analyze", help="classify every kernel's pointer parameters")
    a.add_argument("file", help="PTX file ('-' for stdin)")
    a.add_argument("--json", action="store_true", help="print JSON for programs")
    i = sub.add_parser("instrument", help="rewrite PTX with address-range probes")
    i.add_argument("file")
    i.add_argument("-o", "--output", required=True, help="instrumented PTX path")
    i.add_argument("--sites", help="write the site table as JSON here")
    args = ap.parse_args(argv)
    try:
        text = _read(args.file)
    except OSError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    try:
        if args.cmd == "analyze":
            rep = report(text)
            print(json.dumps(rep, indent=1) if args.json else format_table(rep))
            return 0
        res = instrument(text)
    except PtxError as exc:
        print(f"{args.file}: {exc}", file=sys.stderr)
        return 2
    with open(args.output, "w", encoding="utf-8") as fh:
        fh.write(res.text)
    if args.sites:
        with open(args.sites, "w", encoding="utf-8") as fh:
            json.dump({"sites": [s.to_json() for s in res.sites], "kernels": res.kernels}, fh, indent=1)
    print(f"{len(res.sites)} sites in {len(res.kernels)} kernels -> {args.output}")
    return 0

"""``tessera keys DIR [--client NAME ...]``: create a cluster key directory,
or add allowed clients to one (see ``transport.auth`` for the model)."""
from __future__ import annotations

import argparse

from transport import auth


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("dir", help="key directory to create (mode 0700), or to add clients to")
    p.add_argument("--client", action="append", default=[],
                   help="add an allowed client keypair NAME (repeatable); a new directory gets 'client'")


def main(args: argparse.Namespace) -> int:
    from pathlib import Path
    root = Path(args.dir)
    if not (root / "server.key_secret").exists():
        auth.create_key_dir(root, tuple(args.client) or ("client",))
        print(f"created cluster keys in {root}: server keypair, allowed clients {args.client or ['client']}")
    elif not args.client:
        raise auth.AuthError(f"{root} already holds cluster keys; use --client NAME to add a client")
    else:
        for name in args.client:
            key = auth.add_client(root, name)
            print(f"added client {name!r} (public key {key.decode()}) to {root}")
    print(f"use it with: python -m tessera_actors.node --keys {root} ...  (or TESSERA_KEYS={root} for any process)")
    return 0

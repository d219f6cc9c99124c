"""An unauthenticated local process, as an attacker would write it: raw
ZeroMQ sockets, the project's own codec, but not the cluster's keys.

``python attacker.py SPEC_JSON`` where the spec is a list of attempts
``{"name", "endpoint", "target", "message", "mode", "server_public"}``;
``mode`` is ``null`` (no CURVE at all) or ``curve`` (CURVE with the server's
public key, which is not secret, and a keypair of its own).  For each
attempt it connects, sends the message as an ask, waits for the handshake's
outcome on a socket monitor (bounded by 10 s) and prints one JSON line per
attempt: ``{"name", "handshake": "failed"|"succeeded"|"none", "answered": bool}``.
The environment of this process has no TESSERA_* variables.
"""
import json
import sys

import zmq
from zmq.utils.monitor import recv_monitor_message

from tessera_actors.runtime.messages import (Describe, GetStats, InstallPlan, Ping, Register, Shutdown, Uninstall)
from transport import codec
from transport.codec import OP_ASK, OP_STOP, Envelope

MESSAGES = {
    "ping": Ping(b"who is there"),
    "describe": Describe(),
    "register": Register("evil", "tcp://127.0.0.1:9", ["cpu"], 1),
    "install_from_file": InstallPlan("evil", 0, b"", b"", []),
    "stats": GetStats(),
    "uninstall": Uninstall("p"),
    "shutdown": Shutdown(),
}
_FAILED = {zmq.EVENT_HANDSHAKE_FAILED_AUTH, zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL, zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL}


def attempt(ctx, spec: dict) -> dict:
    sock = ctx.socket(zmq.DEALER)
    sock.linger = 0
    if spec["mode"] == "curve":
        public, secret = zmq.curve_keypair()
        sock.curve_serverkey = spec["server_public"].encode()
        sock.curve_publickey, sock.curve_secretkey = public, secret
    monitor = sock.get_monitor_socket()
    sock.connect(spec["endpoint"])
    op = OP_STOP if spec["message"] == "stop" else OP_ASK
    msg = MESSAGES.get(spec["message"], Ping())
    sock.send_multipart(codec.encode(msg, Envelope(op, 1, spec["target"])))
    outcome = "none"
    while monitor.poll(10_000):
        event = recv_monitor_message(monitor)["event"]
        if event in _FAILED:
            outcome = "failed"
            break
        if event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
            outcome = "succeeded"
            break
    answered = bool(sock.poll(100 if outcome == "failed" else 5000))
    sock.disable_monitor()
    monitor.close()
    sock.close()
    return {"name": spec["name"], "handshake": outcome, "answered": answered}


def main(specs: list) -> int:
    ctx = zmq.Context()
    for spec in specs:
        print(json.dumps(attempt(ctx, spec)), flush=True)
    ctx.term()
    return 0


if __name__ == "__main__":
    sys.exit(main(json.loads(sys.argv[1])))

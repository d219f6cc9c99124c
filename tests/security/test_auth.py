"""Keys as a user handles them: ``tessera keys`` directories, shared secret
files, clear errors for keys that cannot be used, a node daemon that will
not run without keys unless told ``--insecure``, and a peer with the wrong
keys told so at once (not after its ask's timeout)."""
import os
import subprocess
import sys

import pytest

from tessera_actors.runtime.actor import Actor
from tessera_actors.runtime.messages import Describe, Ping, Pong
from transport.system import ActorSystem
from transport import auth
from transport.auth import AuthError, ClusterKeys, HandshakeFailed

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def cli(*args, env=None):
    return subprocess.run([sys.executable, "-m", "tessera_actors.cli", *args], capture_output=True, text=True,
                          env={**(env or os.environ), "PYTHONPATH": REPO}, timeout=120)


def test_keys_command_creates_a_private_directory_and_adds_clients(tmp_path):
    root = tmp_path / "cluster"
    r = cli("keys", str(root))
    assert r.returncode == 0, r.stderr
    assert oct(root.stat().st_mode & 0o777) == "0o700"
    assert oct((root / "server.key_secret").stat().st_mode & 0o777) == "0o600"
    keys = ClusterKeys.from_dir(root)
    assert keys.allows(keys.client_public) and len(keys.allowed) == 1
    r = cli("keys", str(root), "--client", "bob")
    assert r.returncode == 0 and "added client 'bob'" in r.stdout
    bob = ClusterKeys.from_dir(root, client="bob")
    assert bob.server_public == keys.server_public and keys.client_public != bob.client_public
    assert ClusterKeys.from_dir(root).allows(bob.client_public)
    r = cli("keys", str(root))
    assert r.returncode == 2 and "already holds cluster keys" in r.stderr


def test_unusable_keys_are_clear_errors(tmp_path):
    root = auth.create_key_dir(tmp_path / "k")
    os.chmod(root, 0o755)
    with pytest.raises(AuthError, match="accessible by other users"):
        ClusterKeys.from_dir(root)
    with pytest.raises(AuthError, match="not a key directory|No such file"):
        ClusterKeys.from_dir(tmp_path / "missing")
    secret = tmp_path / "secret"
    secret.write_bytes(b"short")
    os.chmod(secret, 0o600)
    with pytest.raises(AuthError, match="at least 16 bytes"):
        ClusterKeys.from_secret_file(secret)


async def test_members_with_one_secret_file_talk_and_others_are_refused_at_once(tmp_path):
    secret = tmp_path / "secret"
    secret.write_bytes(os.urandom(32).hex().encode())
    os.chmod(secret, 0o600)
    keys = ClusterKeys.from_secret_file(secret)
    async with ActorSystem("a", keys=keys) as a, ActorSystem("b", keys=ClusterKeys.from_secret_file(secret)) as b, \
            ActorSystem("c") as stranger:
        await a.spawn(Actor(), "plain")
        address = await a.listen()
        assert await (await b.remote_ref(address, "plain")).ask(Ping(b"hi"), timeout=10) == Pong(b"hi")
        with pytest.raises(HandshakeFailed, match="security handshake failed"):
            await (await stranger.remote_ref(address, "x")).ask(Ping(), timeout=30)   # fails long before 30 s


async def test_node_daemon_needs_keys_or_insecure(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("TESSERA_")}
    r = subprocess.run([sys.executable, "-m", "tessera_actors.node", "--devices", "cpu"], capture_output=True,
                       text=True, env={**env, "PYTHONPATH": REPO}, timeout=60)
    assert r.returncode == 2 and "no cluster keys" in r.stderr and "--insecure" in r.stderr
    root = auth.create_key_dir(tmp_path / "k")
    proc = subprocess.Popen([sys.executable, "-m", "tessera_actors.node", "--devices", "cpu", "--keys", str(root),
                             "--name", "keyed"], stdout=subprocess.PIPE, text=True, env={**env, "PYTHONPATH": REPO})
    try:
        endpoint = proc.stdout.readline().split()[-1]
        async with ActorSystem("member", keys=ClusterKeys.from_dir(root)) as member:
            assert (await (await member.remote_ref(endpoint, "node")).ask(Describe(), timeout=10)).node == "keyed"
        async with ActorSystem("outsider") as outsider:   # this process's own keys are not the cluster's
            with pytest.raises(HandshakeFailed):
                await (await outsider.remote_ref(endpoint, "node")).ask(Ping(), timeout=30)
    finally:
        proc.terminate()
        assert proc.wait(10) == 0
    proc = subprocess.Popen([sys.executable, "-m", "tessera_actors.node", "--devices", "cpu", "--insecure"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**env, "PYTHONPATH": REPO})
    try:
        endpoint = proc.stdout.readline().split()[-1]
        async with ActorSystem("plain", insecure=True) as plain:
            assert await (await plain.remote_ref(endpoint, "node")).ask(Ping(b"x"), timeout=10) == Pong(b"x")
    finally:
        proc.terminate()
        proc.wait(10)
    assert "runs with --insecure: authentication is off" in proc.stderr.read()

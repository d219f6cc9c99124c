"""The peer process of ``test_remote``'s two-process test, and the sum
messages both sides speak: run as a script, it hosts a ``summer`` actor that
answers ``RemoteSum`` with the sum and the tensor doubled, prints its address
and exits 0 on SIGTERM."""
import asyncio
import signal

from tessera_actors.runtime.actor import Actor, handler
from tessera_actors.runtime.messages import message
from transport.system import ActorSystem


@message
class RemoteSum:
    tensor: object = None


@message
class RemoteSummed:
    total: float = 0.0
    echo: object = None


class Doubler(Actor):
    @handler(RemoteSum)
    def sum(self, msg):
        return RemoteSummed(float(msg.tensor.float().sum()), msg.tensor * 2)


async def main() -> None:
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    async with ActorSystem("child") as system:
        await system.spawn(Doubler(), "summer")
        print(await system.listen(), flush=True)
        await stop.wait()


if __name__ == "__main__":
    asyncio.run(main())

"""A TCP proxy on loopback that holds every client->server chunk for `delay` seconds.

With it in front of each cluster node, a call that waits for k replies in a row from one
node takes at least k * delay: elapsed time counts round trips per shard, whatever the
client does inside (pipelining, several writes, TCP segmentation).
"""

from __future__ import annotations

import asyncio
import threading

__all__ = ["DelayProxies"]


class DelayProxies:
    """One proxy per target port; `resolve(host, port)` maps a node to its proxy."""

    def __init__(self, ports: list[int], delay: float) -> None:
        self.delay = delay
        self.map: dict[int, int] = {}
        self._loop = asyncio.new_event_loop()
        self._servers = []
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._thread.start()
        for port in ports:
            server = asyncio.run_coroutine_threadsafe(self._listen(port), self._loop).result(5)
            self._servers.append(server)
            self.map[port] = server.sockets[0].getsockname()[1]

    def resolve(self, host: str, port: int) -> tuple[str, int]:
        return host, self.map.get(port, port)

    async def _listen(self, port: int):
        async def handle(reader, writer):
            try:
                up_r, up_w = await asyncio.open_connection("127.0.0.1", port)
            except OSError:
                writer.close()
                return
            await asyncio.gather(self._pump(reader, up_w, self.delay),
                                 self._pump(up_r, writer, 0.0), return_exceptions=True)

        return await asyncio.start_server(handle, "127.0.0.1", 0)

    async def _pump(self, reader, writer, delay: float) -> None:
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()

        async def send():
            while (item := await queue.get()) is not None:
                due, data = item
                await asyncio.sleep(max(0.0, due - loop.time()))
                writer.write(data)
                await writer.drain()
            writer.close()

        sender = loop.create_task(send())
        try:
            while data := await reader.read(1 << 16):
                await queue.put((loop.time() + delay, data))
        finally:
            await queue.put(None)
            await sender

    def close(self) -> None:
        # The connections' pumps end here, on the loop: left pending, each would be
        # finalized whenever the GC meets it, on whatever thread runs then.
        async def stop():
            for server in self._servers:
                server.close()
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        asyncio.run_coroutine_threadsafe(stop(), self._loop).result(5)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5)

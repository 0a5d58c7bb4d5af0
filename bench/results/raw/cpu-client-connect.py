"""When one aiohttp client process's requests leave it: N streamed POSTs started together against a bare asyncio
server in another process that records when each body arrived.

    python bench/results/raw/cpu-client-connect.py 64 cold|warm [pre]

warm: the N keep-alive connections are opened (one GET each) before the clock; pre: the bodies are encoded before
it too. The figures are in `../h100-burst-intake.md`."""

import asyncio
import json
import multiprocessing as mp
import random
import sys
import time

import aiohttp

PORT = 18778
OK = b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok"


def content_length(head: bytes) -> int:
    for line in head.split(b"\r\n"):
        if line.lower().startswith(b"content-length"):
            return int(line.split(b":")[1])
    return 0


def server_process(queue) -> None:
    arrivals: list[float] = []

    async def handle(reader, writer) -> None:
        while True:
            data = b""
            while b"\r\n\r\n" not in data:
                chunk = await reader.read(65536)
                if not chunk:
                    return
                data += chunk
            head, body = data.split(b"\r\n\r\n", 1)
            if head.startswith(b"GET"):
                writer.write(OK)
                await writer.drain()
                continue
            while len(body) < content_length(head):
                body += await reader.read(65536)
            arrivals.append(time.perf_counter())
            await asyncio.sleep(2.5)  # hold the stream open, as a long completion would
            return

    async def main() -> None:
        await asyncio.start_server(handle, "127.0.0.1", PORT, backlog=2048)
        queue.put("ready")
        await asyncio.sleep(6)
        queue.put(arrivals)

    asyncio.run(main())


async def client(n: int, warm: bool, pre: bool) -> tuple[float, list[float]]:
    rng = random.Random(0)
    prompts = [[rng.randrange(49152) for _ in range(rng.randint(100, 1024))] for _ in range(n)]
    sent: list[float] = []

    async def on_sent(session, ctx, params) -> None:
        sent.append(time.perf_counter())

    trace = aiohttp.TraceConfig()
    trace.on_request_chunk_sent.append(on_sent)
    url = f"http://127.0.0.1:{PORT}"
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=n + 4), trace_configs=[trace]) as session:
        if warm:
            async def ping() -> None:
                async with session.get(url + "/health") as resp:
                    await resp.read()

            await asyncio.gather(*(ping() for _ in range(n)))
        bodies = [json.dumps({"prompt": p, "max_tokens": 10, "stream": True}).encode() for p in prompts]

        async def one(i: int) -> None:
            if pre:
                kwargs = {"data": bodies[i], "headers": {"content-type": "application/json"}}
            else:
                kwargs = {"json": {"prompt": prompts[i], "max_tokens": 10, "stream": True}}
            try:
                async with session.post(url + "/v1/completions", timeout=aiohttp.ClientTimeout(total=1.5), **kwargs):
                    pass
            except (asyncio.TimeoutError, aiohttp.ClientError):
                pass  # the server holds every stream open past the timeout

        t0 = time.perf_counter()
        await asyncio.gather(*(one(i) for i in range(n)))
        return t0, sent


def main() -> None:
    n, warm, pre = int(sys.argv[1]), sys.argv[2] == "warm", len(sys.argv) > 3
    queue = mp.Queue()
    server = mp.Process(target=server_process, args=(queue,))
    server.start()
    queue.get()
    t0, sent = asyncio.run(client(n, warm, pre))
    arrivals = queue.get()
    server.join()

    def spread(times: list[float]) -> str:
        ms = [1e3 * (t - t0) for t in sorted(times)]
        return f"{ms[0]:.1f} / {ms[len(ms) // 2]:.1f} / {ms[-1]:.1f} ms"

    print(f"{n} requests, connections {'warm' if warm else 'cold'}, bodies {'pre-encoded' if pre else 'per request'}: "
          f"sent first / median / last {spread(sent)}; arrived {spread(arrivals)} ({len(arrivals)})")


if __name__ == "__main__":
    main()

"""Broken connections when the evaluation's threads share one HTTP client, against one client per
thread (``trainer.task.eval_http.ThreadClients``).

``THREADS`` closed-loop threads POST small completion-sized requests to a uvicorn server on
127.0.0.1 (in a child process; each answer after 0-20 ms; every third thread pauses 50 ms between
requests, so idle and surplus keep-alive connections come and go) for ``SECONDS`` per mode:
``shared`` (one ``httpx.Client`` for all threads, what the evaluation did before) and
``per-thread``. Counts the requests and every transport error by kind. With a shared client,
httpcore's sync pool can close a connection it has already handed to another thread's queued
request (encode/httpcore issue 1110; httpcore 1.0.9), which the request reads as ``EBADF``.

Run: ``.venv/bin/python bench/bench_eval_clients.py [SECONDS] [--smoke]`` (results also in
bench/results/eval_clients.json).
"""

from __future__ import annotations

import argparse
import collections
import os
import subprocess
import sys
import threading
import time

import httpx
from report import parse_with_smoke, save, smoke_path

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from trainer.local.ports import free_port  # noqa: E402
from trainer.task.eval_http import ThreadClients  # noqa: E402

THREADS = 64  # the evaluation's workers
SERVER = """
import asyncio, random, sys
import uvicorn

async def app(scope, receive, send):
    if scope["type"] != "http":
        return
    while (await receive()).get("more_body"):
        pass
    await asyncio.sleep(random.random() * 0.02)
    await send({"type": "http.response.start", "status": 200,
                "headers": [(b"content-type", b"application/json")]})
    await send({"type": "http.response.body", "body": b'{"choices": []}'})

uvicorn.run(app, host="127.0.0.1", port=int(sys.argv[1]), log_level="warning",
            timeout_keep_alive=30)
"""


def load(url: str, seconds: float, client_for) -> dict:
    """``THREADS`` threads POSTing to ``url`` for ``seconds``; ``client_for()`` gives the client."""
    errors: collections.Counter = collections.Counter()
    done = [0]
    lock = threading.Lock()
    stop = time.monotonic() + seconds

    def worker(i: int) -> None:
        while time.monotonic() < stop:
            try:
                client_for().post(url, json={"prompt": list(range(300)), "max_tokens": 32})
                with lock:
                    done[0] += 1
            except httpx.TransportError as e:
                with lock:
                    errors[f"{type(e).__name__}: {e}"] += 1
            if i % 3 == 0:
                time.sleep(0.05)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(THREADS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return {"requests": done[0], "errors": sum(errors.values()), "by_kind": dict(errors)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("seconds", type=float, nargs="?", default=30.0, help="seconds per mode")
    p.add_argument("--out", default=os.path.join(REPO, "bench", "results", "eval_clients.json"))
    args = parse_with_smoke(p, dict(seconds=1.0, out=smoke_path("eval_clients.json")))
    seconds = args.seconds
    port = free_port()
    server = subprocess.Popen([sys.executable, "-c", SERVER, str(port)])
    url = f"http://127.0.0.1:{port}/v1/completions"
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                httpx.get(url)
                break
            except httpx.HTTPError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.1)
        results = {"threads": THREADS, "seconds": seconds}
        with httpx.Client(timeout=10) as shared:
            results["shared"] = load(url, seconds, lambda: shared)
        with ThreadClients(None) as clients:
            results["per-thread"] = load(url, seconds, clients.get)
    finally:
        server.terminate()
        server.wait()
    for mode in ("shared", "per-thread"):
        r = results[mode]
        print(f"{mode:>10}: {r['requests']} requests, {r['errors']} broken: {r['by_kind']}")
    save(args.out, results)


if __name__ == "__main__":
    main()

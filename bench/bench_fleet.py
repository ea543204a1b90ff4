"""Rollout throughput through the fleet router with N = 1, 2, 4, 8, 16 replicas, and the router's
own overhead per request.

Replicas are fake OpenAI-compatible servers on 127.0.0.1 (``tests/trainer/fleet_fakes.py``) that
answer ``/v1/completions`` after ``PER_TOKEN_S`` x ``max_tokens`` (a fixed decode cost), all in
one child process; the router (``trainer.fleet.router``, the real one) runs in a second child
process; this process is the load: ``CLIENTS_PER_REPLICA`` x N closed-loop clients for
``SECONDS`` each.
Targets (the fleet issue): throughput >= 0.8 x N x single up to N = 8; routing overhead p50 <= 2
ms (sequential requests to a replica with no delay, through the router minus direct).

Run: ``.venv/bin/python bench/bench_fleet.py [--smoke]`` (results also in bench/results/fleet.json).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import statistics
import sys
import time

from report import parse_with_smoke, save, smoke_path

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
sys.path.insert(0, os.path.join(REPO, "tests", "trainer"))

PER_TOKEN_S = 0.004
MAX_TOKENS = 16  # 64 ms per request
CLIENTS_PER_REPLICA = 4
SECONDS = 4.0
BODY = {"model": "m", "prompt": [1, 2, 3], "max_tokens": MAX_TOKENS}
ROUTER_KEY = (
    "bench-fleet-key"  # the router's run key (FleetRouter(key=)); a fake replica ignores it
)
AUTH = {"Authorization": f"Bearer {ROUTER_KEY}"}


def _serve_fakes(n: int, per_token_s: float, out) -> None:
    from fleet_fakes import FakeReplica

    fakes = [FakeReplica(per_token_s=per_token_s).start() for _ in range(n)]
    out.send([f.url for f in fakes])
    time.sleep(3600)


def _serve_router(urls: list[str], out) -> None:
    from trainer.fleet.pool import ReplicaPool
    from trainer.fleet.router import FleetRouter
    from trainer.local.ports import free_port

    pool = ReplicaPool(urls, health_interval_s=5.0).start()
    out.send(FleetRouter(pool, wait_s=30.0, key=ROUTER_KEY).start(free_port()))
    time.sleep(3600)


def _start(target, *args):
    parent, child = mp.Pipe()
    proc = mp.Process(target=target, args=(*args, child), daemon=True)
    proc.start()
    return proc, parent.recv()


async def _load(url: str, clients: int, seconds: float) -> int:
    """Closed-loop clients for ``seconds``; returns the requests answered. One connection pool
    per 4 clients: httpcore's pool does work per request that grows with its connections, so
    one pool of 64 was itself the bottleneck (32 in flight: 464 req/s; 64: 138)."""
    import httpx

    done = 0
    deadline = time.monotonic() + seconds
    pools = [httpx.AsyncClient(timeout=30, headers=AUTH) for _ in range((clients + 3) // 4)]

    async def client(c: httpx.AsyncClient) -> None:
        nonlocal done
        while time.monotonic() < deadline:
            r = await c.post(f"{url}/v1/completions", json=BODY)
            r.raise_for_status()
            done += 1

    try:
        await asyncio.gather(*(client(pools[i // 4]) for i in range(clients)))
    finally:
        for c in pools:
            await c.aclose()
    return done


def throughput(n: int, seconds: float = SECONDS) -> float:
    """Requests per second through the router with ``n`` replicas, measured over ``seconds``."""
    fakes, urls = _start(_serve_fakes, n, PER_TOKEN_S)
    router, url = _start(_serve_router, urls)
    try:
        asyncio.run(_load(url, CLIENTS_PER_REPLICA * n, 1.0))  # warm up connections
        done = asyncio.run(_load(url, CLIENTS_PER_REPLICA * n, seconds))
        return done / seconds
    finally:
        router.terminate()
        fakes.terminate()


def overhead_ms(requests: int = 300) -> dict:
    """p50/p90 per sequential request, direct vs through the router (replica without delay)."""
    import httpx

    fakes, urls = _start(_serve_fakes, 1, 0.0)
    router, url = _start(_serve_router, urls)
    out = {}
    try:
        for name, base in (("direct", urls[0]), ("router", url)):
            with httpx.Client(timeout=30, headers=AUTH) as c:
                for _ in range(20):
                    c.post(f"{base}/v1/completions", json=BODY)
                times = []
                for _ in range(requests):
                    t0 = time.perf_counter()
                    c.post(f"{base}/v1/completions", json=BODY).raise_for_status()
                    times.append((time.perf_counter() - t0) * 1e3)
            q = statistics.quantiles(times, n=10)
            out[name] = {"p50_ms": round(statistics.median(times), 3), "p90_ms": round(q[8], 3)}
    finally:
        router.terminate()
        fakes.terminate()
    out["overhead_p50_ms"] = round(out["router"]["p50_ms"] - out["direct"]["p50_ms"], 3)
    return out


def _cpu_s(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` so far (Linux ``/proc``)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def router_cpu(in_flight: int = 64, seconds: float = 10.0) -> dict:
    """The router's own CPU per request with ``in_flight`` requests open at once, as TRL's
    rollout worker keeps them (``max_inflight_tasks`` 64): one replica answering after 0.5 s (a
    vLLM batch step), 300-token prompts."""
    import aiohttp

    body = {**BODY, "prompt": list(range(300)), "max_tokens": 8}
    fakes, urls = _start(_serve_fakes, 1, 0.5 / body["max_tokens"])
    router, url = _start(_serve_router, urls)

    async def load() -> int:
        done = 0
        deadline = time.monotonic() + seconds
        connector = aiohttp.TCPConnector(limit=0)
        async with aiohttp.ClientSession(connector=connector, headers=AUTH) as session:

            async def client() -> None:
                nonlocal done
                while time.monotonic() < deadline:
                    async with session.post(f"{url}/v1/completions", json=body) as r:
                        await r.read()
                        r.raise_for_status()
                    done += 1

            await asyncio.gather(*(client() for _ in range(in_flight)))
        return done

    try:
        cpu0, t0 = _cpu_s(router.pid), time.monotonic()
        done = asyncio.run(load())
        cpu, wall = _cpu_s(router.pid) - cpu0, time.monotonic() - t0
    finally:
        router.terminate()
        fakes.terminate()
    return {
        "in_flight": in_flight,
        "requests_per_s": round(done / wall, 1),
        "router_cpu_ms_per_request": round(1e3 * cpu / done, 2),
        "router_cores": round(cpu / wall, 2),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--replicas", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    p.add_argument("--seconds", type=float, default=SECONDS, help="measured per replica count")
    p.add_argument("--requests", type=int, default=300, help="sequential, for the overhead")
    p.add_argument("--in-flight", type=int, default=64, help="open requests, for the router CPU")
    p.add_argument("--cpu-seconds", type=float, default=10.0, help="measured, for the router CPU")
    p.add_argument("--out", default=os.path.join(REPO, "bench", "results", "fleet.json"))
    smoke = dict(replicas=[1, 2], seconds=1.0, requests=30, in_flight=8, cpu_seconds=1.0)
    args = parse_with_smoke(p, {**smoke, "out": smoke_path("fleet.json")})
    results = {
        "per_request_s": PER_TOKEN_S * MAX_TOKENS,
        "clients_per_replica": CLIENTS_PER_REPLICA,
    }
    rows = []
    single = None
    for n in args.replicas:
        rps = throughput(n, args.seconds)
        single = single or rps
        rows.append(
            {
                "replicas": n,
                "requests_per_s": round(rps, 1),
                "vs_n_x_single": round(rps / (n * single), 2),
            }
        )
        print(f"N={n:2d}: {rps:7.1f} req/s = {rps / (n * single):.2f} x N x single", flush=True)
    results["throughput"] = rows
    results["overhead"] = overhead_ms(args.requests)
    print(json.dumps(results["overhead"]))
    results["router_cpu"] = router_cpu(args.in_flight, args.cpu_seconds)
    print(json.dumps(results["router_cpu"]))
    save(args.out, results)


if __name__ == "__main__":
    main()

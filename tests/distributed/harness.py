"""Run a function on several local processes with the gloo backend, each with a timeout.

`run_ranks(fn, world=2)` spawns `world` processes that join one gloo group (a TCP store on a free local
port), call `fn(rank, world)`, and report back; the caller raises if any rank raised (with every rank's
traceback), and kills all of them if they do not finish within `timeout` seconds or as soon as one dies
without a result (a crashed backend): a test never hangs, and a failure on one rank fails the test.
"""

from __future__ import annotations

import datetime
import io
import multiprocessing as mp
import os
import queue
import socket
import time
import traceback


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(fn, rank, world, port, results, timeout, args):
    os.environ.setdefault("TRITON_INTERPRET", "1")
    import torch
    import torch.distributed as dist

    try:
        dist.init_process_group(
            "gloo",
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=world,
            timeout=datetime.timedelta(seconds=timeout),
        )
        try:
            out = fn(rank, world, *args)
            dist.barrier()  # no rank tears the group down while another still talks to it
        finally:
            dist.destroy_process_group()
        buf = io.BytesIO()
        torch.save(out, buf)  # as bytes: tensors sent through the queue would live in this process's shared memory
        results.put((rank, "ok", buf.getvalue()))
    except BaseException:  # noqa: BLE001 - reported to the parent, which fails the test
        results.put((rank, "error", traceback.format_exc()))


def run_ranks(fn, world: int = 2, timeout: float = 120.0, args: tuple = ()):
    """fn(rank, world, *args) on `world` gloo ranks; returns [result of rank 0, rank 1, ...] or raises."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_worker, args=(fn, r, world, port, results, timeout / 2, args)) for r in range(world)]
    for p in procs:
        p.start()
    got = {}
    deadline = time.monotonic() + timeout
    try:
        while len(got) < world:
            try:
                rank, status, payload = results.get(timeout=0.5)
                got[rank] = (status, payload)
                continue
            except queue.Empty:
                pass
            dead = [r for r, p in enumerate(procs) if r not in got and not p.is_alive()]
            if dead and results.empty():
                raise AssertionError(
                    f"ranks {dead} died without a result (exit codes {[procs[r].exitcode for r in dead]})"
                )
            if time.monotonic() > deadline:
                raise AssertionError(f"ranks {sorted(set(range(world)) - set(got))} did not finish in {timeout} s")
    finally:
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
    errors = [f"rank {r}:\n{payload}" for r, (status, payload) in sorted(got.items()) if status == "error"]
    if errors:
        raise AssertionError("\n".join(errors))
    import torch

    return [torch.load(io.BytesIO(got[r][1]), weights_only=False) for r in range(world)]

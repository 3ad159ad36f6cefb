"""Run a function on N local ranks with a process group, with a deadline.

Used by the CLI demo and the test-suite. A rank that hangs (for example in a collective
its peers never entered) makes `spawn` raise `TimeoutError` after `timeout` seconds
instead of blocking forever; a rank that raises makes it raise `RankError` with every
failing rank's traceback.
"""

import multiprocessing as mp
import os
import pickle
import tempfile
import time
import traceback
from datetime import timedelta
from typing import Any, Callable, List, Optional, Sequence


class RankError(RuntimeError):
    """One or more ranks raised; `.errors` maps rank -> formatted traceback."""

    def __init__(self, errors):
        self.errors = errors
        text = "\n".join(f"--- rank {r} ---\n{tb}" for r, tb in sorted(errors.items()))
        super().__init__(f"{len(errors)} rank(s) failed:\n{text}")


# What `spawn` uses when its caller names no start method or preload (`set_spawn_defaults`).
_DEFAULTS = {"start_method": "spawn", "preload": ()}


def set_spawn_defaults(*, start_method: Optional[str] = None, preload: Optional[Sequence[str]] = None) -> None:
    """The start method and preload `spawn` uses when its caller names none (a test suite:
    "forkserver" with torch and transformers preloaded starts a 4-rank group in 0.2 s
    instead of 15 s of imports on 2 cores). The forkserver is started once per process, by
    the first forkserver spawn: its preload is that call's."""
    if start_method is not None:
        _DEFAULTS["start_method"] = start_method
    if preload is not None:
        _DEFAULTS["preload"] = tuple(preload)


def _worker(fn, rank, world_size, args, backend, init_file, timeout, threads, queue, env):
    # A forkserver's child has the server's environment: give it the caller's, as a
    # spawned child has (the kernels' and the package's switches are read from it).
    for key in set(os.environ) - set(env):
        del os.environ[key]
    os.environ.update(env)
    import torch
    import torch.distributed as dist

    torch.set_num_threads(threads)
    os.environ.setdefault("OMP_NUM_THREADS", str(threads))
    try:
        if backend == "nccl":
            torch.cuda.set_device(rank % torch.cuda.device_count())
        dist.init_process_group(backend, init_method=f"file://{init_file}", rank=rank,
                                world_size=world_size, timeout=timedelta(seconds=timeout))
        try:
            result = fn(rank, world_size, *args)
        finally:
            dist.destroy_process_group()
        # Plain pickle: tensors travel by value (torch's queue reducers would use shared
        # memory that disappears when this process exits).
        queue.put((rank, True, pickle.dumps(result)))
    except BaseException:  # report everything, including KeyboardInterrupt in a child
        queue.put((rank, False, traceback.format_exc()))


def spawn(fn: Callable, world_size: int, *, args: Sequence[Any] = (), backend: str = "gloo",
          timeout: float = 120.0, threads: int = 1, start_method: Optional[str] = None,
          preload: Optional[Sequence[str]] = None) -> List[Any]:
    """Run `fn(rank, world_size, *args)` on `world_size` processes; return their results.

    `fn` must be importable (a module-level function). Raises `TimeoutError` if any rank
    has not finished after `timeout` seconds (all ranks are then killed) and `RankError`
    if any rank raised. start_method="forkserver" with `preload` (module names) forks the
    ranks from a server that has imported those modules once: ranks start in well under a
    second instead of importing torch and transformers each. Unnamed, both come from
    `set_spawn_defaults` ("spawn", nothing preloaded). Every rank sees the caller's
    environment variables as they are at the call, whatever the start method.
    """
    start_method = start_method or _DEFAULTS["start_method"]
    preload = _DEFAULTS["preload"] if preload is None else preload
    ctx = mp.get_context(start_method)
    if preload and start_method == "forkserver":
        ctx.set_forkserver_preload(list(preload))
    queue = ctx.Queue()
    fd, init_file = tempfile.mkstemp(prefix="ulysses_kernels_init_")
    os.close(fd)
    os.unlink(init_file)  # FileStore wants a path it creates itself
    procs = [ctx.Process(target=_worker, daemon=True,
                         args=(fn, r, world_size, tuple(args), backend, init_file, timeout, threads, queue,
                               dict(os.environ)))
             for r in range(world_size)]
    for p in procs:
        p.start()
    results, errors = {}, {}
    deadline = time.monotonic() + timeout
    try:
        while len(results) + len(errors) < world_size:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                missing = sorted(set(range(world_size)) - set(results) - set(errors))
                raise TimeoutError(f"ranks {missing} did not finish within {timeout:.0f}s "
                                   f"(a hang?); finished: {sorted(results)}, failed: {sorted(errors)}")
            try:
                rank, ok, payload = queue.get(timeout=min(remaining, 1.0))
            except Exception:  # queue.Empty: check that nobody died silently
                dead = [r for r, p in enumerate(procs)
                        if p.exitcode not in (None, 0) and r not in results and r not in errors]
                for r in dead:
                    errors[r] = f"process exited with code {procs[r].exitcode} without reporting"
                continue
            if ok:
                results[rank] = pickle.loads(payload)
            else:
                errors[rank] = payload
    finally:
        for p in procs:
            p.join(timeout=5 if not errors else 1)
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
        if os.path.exists(init_file):
            os.unlink(init_file)
    if errors:
        raise RankError(errors)
    return [results[r] for r in range(world_size)]


def torchrun_main(run: Callable, example: str) -> None:
    """The body of a script launched by `torchrun`: one process group (NCCL with one GPU per
    rank, else gloo with the cores shared out), `run(rank, world, argv)`, teardown.
    `example` is the launch line printed when the script is started without torchrun."""
    import sys

    import torch
    import torch.distributed as dist

    if "RANK" not in os.environ:
        sys.exit(f"launch with torchrun, e.g. {example}")
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    else:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ.get("LOCAL_WORLD_SIZE", 1))))
    dist.init_process_group(backend)
    try:
        run(dist.get_rank(), dist.get_world_size(), sys.argv[1:])
    finally:
        dist.destroy_process_group()

"""Test worker: joins the cluster, checks cross-process sums and batch assembly, then "trains".

Run under ``jaxpar launch``; writes ``rank_<i>.json`` into ``--out``. Fault switches make one
rank crash, kill itself or never join, for the launcher's fault tests.
"""

import argparse
import json
import os
import signal
import sys
import time


def parse():
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--steps", type=int, default=1)
    p.add_argument("--step-sleep", type=float, default=0.0)
    p.add_argument("--fail-rank", type=int, default=-1)
    p.add_argument("--fail-step", type=int, default=0)
    p.add_argument("--fail-how", choices=("raise", "kill", "exit", "sysexit"), default="raise",
                   help="an uncaught exception, SIGKILL to itself, os._exit(--exit-code) or "
                        "sys.exit(--exit-code)")
    p.add_argument("--skip-checks", action="store_true",
                   help="skip the start-up checks (fault tests only need the steps)")
    p.add_argument("--step-psum", action="store_true",
                   help="a cross-process sum every step, so a dead peer fails the others")
    p.add_argument("--exit-code", type=int, default=3)
    p.add_argument("--never-join-rank", type=int, default=-1)
    p.add_argument("--tag", default="")
    return p.parse_args()


def step_sum(jax, np):
    """A jitted cross-process sum over all devices: the collective a training step runs."""
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    mesh = Mesh(np.array(jax.devices()), ("all",))
    ones = jax.make_array_from_callback((jax.device_count(),), NamedSharding(mesh, P("all")),
                                        lambda i: np.ones(1, np.float32))
    total = jax.jit(lambda x: x.sum(), out_shardings=NamedSharding(mesh, P()))
    return lambda: float(total(ones))


def checks(jax, np, dist):
    """Cross-process sum, and global batches from per-process rows and from full batches."""
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    n = jax.device_count()
    mesh = Mesh(np.array(jax.devices()).reshape(2, n // 2), ("data", "model"))
    full = np.arange(16 * 3, dtype=np.float32).reshape(16, 3)
    rows = full[dist.process_rows(16)]
    sharding = NamedSharding(mesh, P("data"))
    total = jax.jit(lambda x: x.sum(), out_shardings=NamedSharding(mesh, P()))
    gather = jax.jit(lambda x: x, out_shardings=NamedSharding(mesh, P()))
    equal = lambda a: bool(np.array_equal(np.asarray(gather(a).addressable_data(0)), full))
    batch = dist.make_global_batch({"x": rows}, sharding)
    same = dist.make_global_batch({"x": full}, sharding, per_process=False)
    ones = jax.make_array_from_callback((n,), NamedSharding(mesh, P(("data", "model"))),
                                        lambda i: np.ones(1, np.float32))
    return {
        "psum": float(total(ones)),
        "batch_equal": equal(batch["x"]),
        "full_equal": equal(same["x"]),
        "shape": list(batch["x"].shape),
    }


def main():
    args = parse()
    if int(os.environ.get("JAXPAR_PROCESS_ID", -2)) == args.never_join_rank:
        rank = args.never_join_rank
        print(f"rank {rank}: not joining", flush=True)
        time.sleep(3600)
    import jaxpar.distributed as dist

    spec = dist.initialize()
    assert dist.initialize() is spec  # idempotent
    rank = spec.process_id
    import jax
    import numpy as np

    print(f"rank {rank}: joined, {jax.process_count()} processes, {jax.device_count()} devices",
          flush=True)
    result = {"rank": rank, "process_count": jax.process_count(),
              "device_count": jax.device_count(), "local_device_count": jax.local_device_count(),
              "source": spec.source, **({} if args.skip_checks else checks(jax, np, dist))}
    step_fn = step_sum(jax, np) if args.step_psum else lambda: None
    for step in range(args.steps):
        if rank == args.fail_rank and step == args.fail_step:
            print(f"rank {rank}: failing at step {step}", flush=True)
            if args.fail_how == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            if args.fail_how == "exit":
                os._exit(args.exit_code)
            if args.fail_how == "sysexit":
                sys.exit(args.exit_code)
            raise RuntimeError(f"rank {rank} fails on purpose at step {step}")
        step_fn()
        print(f"rank {rank}: step {step}", flush=True)
        time.sleep(args.step_sleep)
    # written whole, then renamed: a test polling for reports never reads a half-written one
    path = os.path.join(args.out, f"rank_{rank}.json")
    with open(path + ".tmp", "w") as f:
        json.dump(result, f)
    os.replace(path + ".tmp", path)


if __name__ == "__main__":
    main()

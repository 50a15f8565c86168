"""The ``jaxpar launch`` and ``jaxpar k8s`` subcommands (``python -m jaxpar.launch ARGS`` is
``jaxpar launch ARGS``): their flags become a `jaxpar.launch.LaunchConfig` / `K8sJob`."""

from __future__ import annotations

import argparse
import os
import shutil
import sys
from collections.abc import Sequence

from jaxpar.cli.common import UserError
from jaxpar.launch import k8s, launcher

_LAUNCH_HELP = "start this node's worker processes of a multi-process job (msrun-like)"
_LAUNCH_EPILOG = """\
examples:
  # one machine, 2 processes x 4 simulated CPU devices
  jaxpar launch --worker-num 2 --local-worker-num 2 --simulated-devices 4 \\
      examples/train_gpt.py --steps 30
  # two nodes, 8 processes each; run on each node with its --node-rank
  jaxpar launch --worker-num 16 --local-worker-num 8 --master-addr 10.0.0.1 \\
      --master-port 8118 --node-rank 0 --log-dir logs train.py
  (rank 0's coordinator listens on 10.0.0.1 only; it has no authentication, so keep the
  port behind a firewall)
  # 2 parameter servers, then 2 workers told where they are (JAXPAR_PS_ADDRESSES/_TOKEN)
  jaxpar launch --worker-num 2 --local-worker-num 2 --servers 2 --log-dir logs train.py
Option names also accept msrun's spelling (--worker_num, --master_addr, ...).
"""


def _flag(parser, name: str, **kwargs) -> None:
    """Adds ``--a-b`` with msrun's ``--a_b`` as an alias."""
    alias = "--" + name[2:].replace("-", "_")
    names = [name] + ([alias] if alias != name else [])
    parser.add_argument(*names, **kwargs)


def _add_launch_arguments(p: argparse.ArgumentParser) -> None:
    d = launcher.LaunchConfig()
    _flag(p, "--worker-num", type=int, default=d.worker_num,
          help="processes in the whole job (default %(default)s)")
    _flag(p, "--local-worker-num", type=int, default=d.local_worker_num,
          help="processes on this node (default %(default)s)")
    _flag(p, "--master-addr", default=d.master_addr,
          help="host of rank 0, the coordinator (default %(default)s)")
    _flag(p, "--master-port", type=int, default=d.master_port,
          help="coordinator port (default %(default)s)")
    _flag(p, "--bind-address", default=None, metavar="IP[:PORT]",
          help="where rank 0's coordinator listens (default: the --master-addr interface, "
               "so 127.0.0.1 stays on loopback). JAX's coordination service has no "
               "authentication: 0.0.0.0 lets anyone who reaches the port join the job")
    _flag(p, "--node-rank", type=int, default=d.node_rank,
          help="index of this node (default %(default)s)")
    _flag(p, "--log-dir", default=d.log_dir,
          help="folder for worker_<rank>.log and launcher_<node>.log (default %(default)s)")
    p.add_argument("--join", action="store_true",
                   help="stream the workers' output to stdout, prefixed by rank")
    _flag(p, "--cluster-time-out", type=float, default=d.cluster_time_out,
          help="seconds to wait for all workers to join (default %(default)s)")
    _flag(p, "--simulated-devices", type=int, default=None, metavar="K",
          help="K CPU devices per process (CPU machines; not with --devices-per-worker)")
    _flag(p, "--devices-per-worker", type=int, default=None, metavar="D",
          help="give local worker i accelerators i*D..i*D+D-1 (not with --simulated-devices)")
    _flag(p, "--kill-time-out", type=float, default=d.kill_time_out,
          help="on Ctrl-C/SIGTERM: seconds between SIGTERM and SIGKILL to the workers "
               "(default %(default)s)")
    _flag(p, "--exit-time-out", type=float, default=d.exit_time_out,
          help="seconds the other workers may run on after one worker's script ended with "
               "code 0, before the launcher stops the job (default %(default)s)")
    _flag(p, "--worker-restarts", type=int, default=d.worker_restarts, metavar="K",
          help="when a worker fails, stop the others and start the worker group again, at most "
               "K times (servers keep running; the script resumes from its own checkpoint; on "
               "several nodes the launchers agree through node 0's rendezvous) (default %(default)s)")
    _flag(p, "--min-workers", type=int, default=None, metavar="N",
          help="several nodes: after a failure, go on without the nodes that do not come back "
               "within --rejoin-time-out while N workers remain (default: --worker-num, never fewer)")
    _flag(p, "--rendezvous-port", type=int, default=None, metavar="P",
          help="several nodes with --worker-restarts: port of node 0's rendezvous on --master-addr "
               "(default: --master-port + 1)")
    _flag(p, "--rejoin-time-out", type=float, default=d.rejoin_time_out,
          help="several nodes: seconds to wait for every node to join again after a failure "
               "(default %(default)s)")
    _add_server_arguments(p, d)
    p.add_argument("script", help="Python script (or executable) each worker runs")
    # argparse counts a REMAINDER positional as required, and named it in "the following arguments are
    # required: script, script_args" when the script was missing; the script may take no arguments
    p.add_argument("script_args", nargs=argparse.REMAINDER, help="arguments for the script").required = False


def _add_server_arguments(p: argparse.ArgumentParser, d: launcher.LaunchConfig) -> None:
    g = p.add_argument_group("parameter servers (started by node 0's launcher)")
    g.add_argument("--servers", type=int, default=None, metavar="N",
                   help="start N parameter-server processes before the workers; workers get "
                        "JAXPAR_PS_ADDRESSES and JAXPAR_PS_TOKEN")
    _flag(g, "--server-restarts", type=int, default=d.server_restarts, metavar="K",
          help="restart a server that dies at most K times (default %(default)s)")
    _flag(g, "--server-port", type=int, default=None, metavar="P",
          help="server i listens on P+i (default: free ports; needed on several nodes)")
    _flag(g, "--server-time-out", type=float, default=d.server_time_out,
          help="seconds to wait for the servers to be ready (default %(default)s)")
    _flag(g, "--server-checkpoint-dir", default=None, metavar="DIR",
          help="where servers checkpoint their shards (default <log-dir>/ps_checkpoints)")
    _flag(g, "--server-checkpoint-every", type=int, default=None, metavar="S",
          help="steps between a server's full shard checkpoints (default: the server's own)")
    _flag(g, "--server-module", default=d.server_module,
          help="module each server runs with python -m (default %(default)s)")


def add_launch_parser(subparsers) -> argparse.ArgumentParser:
    """Registers ``launch`` on an argparse ``subparsers``; ``args.func(args)`` returns the exit code."""
    p = subparsers.add_parser(
        "launch", help=_LAUNCH_HELP, description=_LAUNCH_HELP, epilog=_LAUNCH_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        # the script's own flags follow it untouched: with abbreviations on, a script flag that begins
        # a launcher flag's name (--local, --worker) was refused as "ambiguous" before the script ran
        allow_abbrev=False,
    )
    _add_launch_arguments(p)
    p.set_defaults(func=run_launch)
    return p


def launch_config(args: argparse.Namespace) -> launcher.LaunchConfig:
    """The LaunchConfig that parsed ``jaxpar launch`` arguments describe."""
    return launcher.LaunchConfig(
        worker_num=args.worker_num, local_worker_num=args.local_worker_num,
        master_addr=args.master_addr, master_port=args.master_port, node_rank=args.node_rank,
        log_dir=args.log_dir, join=args.join, cluster_time_out=args.cluster_time_out,
        simulated_devices=args.simulated_devices, devices_per_worker=args.devices_per_worker,
        kill_time_out=args.kill_time_out, exit_time_out=args.exit_time_out,
        bind_address=args.bind_address, servers=args.servers,
        server_restarts=args.server_restarts, server_port=args.server_port,
        server_time_out=args.server_time_out, server_checkpoint_dir=args.server_checkpoint_dir,
        server_module=args.server_module, server_checkpoint_every=args.server_checkpoint_every,
        worker_restarts=args.worker_restarts, min_workers=args.min_workers,
        rendezvous_port=args.rendezvous_port, rejoin_time_out=args.rejoin_time_out,
    )


def check_script(script: str) -> None:
    """Refuse a workers' script that does not exist, or a directory (naming the scripts in it),
    before any worker starts: each worker would fail on its own with "can't open file"."""
    if not os.path.exists(script):
        found = shutil.which(script) if os.sep not in script else None
        hint = f"; {script!r} is a command on PATH: give its path, {found}" if found else ""
        raise ValueError(f"script {script!r} does not exist (relative paths start at {os.getcwd()}); give the path "
                         f"of the Python script (or executable) each worker runs{hint}")
    if not os.path.isdir(script):
        _check_interpreter(script)
        return
    scripts = sorted(name for name in os.listdir(script) if name.endswith(".py"))[:3]
    inside = f" (it holds {', '.join(scripts)})" if scripts else ""
    example = os.path.join(script, scripts[0] if scripts else "train.py")
    raise ValueError(f"script {script!r} is a directory{inside}; give the Python script (or executable) each "
                     f"worker runs, e.g. jaxpar launch ... {example}")


def _check_interpreter(script: str) -> None:
    """A script that is not executable runs under Python (see `launcher.worker_command`): refuse one
    whose ``#!`` line names another interpreter, which every worker would fail on with a SyntaxError."""
    if script.endswith(".py") or os.access(script, os.X_OK):
        return
    try:
        with open(script, "rb") as f:
            first = f.readline(200).decode(errors="replace").strip()
    except OSError:
        return
    if first.startswith("#!") and "python" not in first:
        raise ValueError(f"script {script!r} starts with {first!r} but is not executable, so each worker would run it "
                         f"with Python; make it executable (chmod +x {script}) or give a Python script")


def run_launch(args: argparse.Namespace) -> int:
    """Handler of ``jaxpar launch``."""
    try:
        config = launch_config(args)
        check_script(args.script)
        launcher.check_node(config)
    except ValueError as err:
        raise UserError(str(err)) from err
    return launcher.launch(config, args.script, args.script_args, echo=sys.stdout)


def add_k8s_parser(subparsers) -> argparse.ArgumentParser:
    """Registers ``k8s`` on an argparse ``subparsers``; ``args.func(args)`` returns the exit code."""
    text = "print a Kubernetes manifest (headless Service + indexed Job, or a JobSet) for a job"
    p = subparsers.add_parser(
        "k8s", help=text, description=text,
        epilog="example:\n  jaxpar k8s --workers 4 --image me/train:1 -- python train.py --steps 100 "
               "| kubectl apply -f -",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--workers", type=int, required=True, help="number of pods (processes)")
    p.add_argument("--image", required=True, help="container image")
    p.add_argument("--name", default="jaxpar",
                   help="name of the Job / JobSet and Service (default %(default)s)")
    p.add_argument("--jobset", action="store_true", help="emit a JobSet instead of Service + Job")
    p.add_argument("--port", type=int, default=k8s.sources.DEFAULT_PORT,
                   help="coordinator port (default %(default)s)")
    p.add_argument("--namespace", default=None, help="namespace of the objects")
    p.add_argument("--gpus-per-worker", type=int, default=0, help="nvidia.com/gpu limit per pod")
    p.add_argument("--simulated-devices", type=int, default=None, metavar="K",
                   help="K CPU devices per pod")
    p.add_argument("--cluster-time-out", type=float, default=None,
                   help="seconds pods wait for each other")
    p.add_argument("--env", action="append", default=[], metavar="NAME=VALUE",
                   help="extra variable (repeatable)")
    p.add_argument("--servers", type=int, default=None, metavar="N",
                   help="add N parameter-server pods (StatefulSet <name>-ps)")
    p.add_argument("--server-port", type=int, default=8500, help="servers' port (default %(default)s)")
    p.add_argument("--server-storage", default=None, metavar="SIZE",
                   help="a volume claim of SIZE (e.g. 20Gi) per server for its checkpoints "
                        "(default: emptyDir)")
    p.add_argument("--ps-token-secret", default=None, metavar="SECRET",
                   help="Secret whose key 'token' holds the job token (default <name>-ps-token)")
    # dest differs from "command": the jaxpar command keeps the subcommand's name there.
    p.add_argument("pod_command", nargs=argparse.REMAINDER, metavar="command",
                   help="-- then the command each pod runs")
    p.set_defaults(func=run_k8s)
    return p


def _env_pairs(items: Sequence[str]) -> dict[str, str]:
    pairs = {}
    for item in items:
        name, sep, value = item.partition("=")
        if not sep or not name:
            raise ValueError(f"--env {item!r} must look like NAME=VALUE, e.g. --env A=1.")
        if name in pairs:
            raise ValueError(f"--env {name} is given twice ({name}={pairs[name]!r} and "
                             f"{item!r}); keep one.")
        pairs[name] = value
    return pairs


def run_k8s(args: argparse.Namespace) -> int:
    """Handler of ``jaxpar k8s``: prints the manifest to stdout."""
    try:
        job = k8s.K8sJob(
            workers=args.workers, image=args.image, command=k8s.command_after_dashes(args.pod_command),
            name=args.name, kind="jobset" if args.jobset else "job", port=args.port,
            namespace=args.namespace, gpus_per_worker=args.gpus_per_worker,
            simulated_devices=args.simulated_devices, cluster_time_out=args.cluster_time_out,
            env=_env_pairs(args.env), servers=args.servers, server_port=args.server_port,
            server_storage=args.server_storage, ps_token_secret=args.ps_token_secret,
        )
    except ValueError as err:
        raise UserError(str(err)) from err
    sys.stdout.write(k8s.manifest(job))
    return 0

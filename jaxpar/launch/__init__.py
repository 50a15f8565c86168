"""Starting a job on many processes and hosts, on JAX's own runtime (``jax.distributed``).

* ``jaxpar launch`` (:func:`launch`, :class:`LaunchConfig`): msrun-like supervisor for one
  node's workers; with ``--servers N`` also the job's parameter-server processes
  (``jaxpar.launch.servers``).
* :func:`detect_cluster` → :class:`ClusterSpec`: the job as the environment describes it
  (``JAXPAR_*`` variables, a rank table, OpenMPI, SLURM, Kubernetes).
* ``jaxpar k8s`` (:func:`k8s_manifest`, :class:`K8sJob`): a Kubernetes manifest for a job.

Workers connect with ``jaxpar.distributed.initialize()``. Nothing here imports JAX.
"""

from jaxpar.launch.cluster import ClusterError, ClusterSpec, detect_cluster
from jaxpar.launch.k8s import K8sJob
from jaxpar.launch.k8s import manifest as k8s_manifest
from jaxpar.launch.launcher import LaunchConfig, launch
from jaxpar.launch.ranktable import RankTable, load_rank_table

__all__ = [
    "ClusterError",
    "ClusterSpec",
    "K8sJob",
    "LaunchConfig",
    "RankTable",
    "detect_cluster",
    "k8s_manifest",
    "launch",
    "load_rank_table",
]

"""Embedding rows outside the model: tables in host memory and parameter servers.

``Trainer(..., rows=source)`` trains them with the dense model in the one training loop: the
source pulls a batch's rows before the compiled step and pushes their gradients after it
(`jaxpar.ps.rows`). `HostEmbedding` / `HostRows`: a table in this process's host memory;
`ServerRows`: tables on parameter servers.
Replica groups (`jaxpar.ps.replicas`, coordinator ``python -m jaxpar.ps.replica_server``):
data-parallel copies of one job that average their gradients through a coordinator, keep
training when one dies and heal it from a live one when it comes back (docs/reliability.md).
Parameter servers (``python -m jaxpar.ps.server``) own hash- or range-partitioned shards of
each table and apply the row optimizer; each worker's Trainer pulls a batch's rows before its step and
pushes their gradients after it (`ServerRows`). See
docs/recommendation.md and docs/parameter_server.md.

Example:
    >>> spec = jaxpar.ps.TableSpec("users", 1000, 8, jaxpar.ps.Adagrad(0.1))
    >>> client = jaxpar.ps.connect([spec], addresses=["127.0.0.1:5555"], token="t")  # doctest: +SKIP
"""

import importlib

from jaxpar.deprecation import former_attribute
from jaxpar.ps.host_embedding import HostEmbedding, HostRows, RowOptimizer
from jaxpar.ps.rows import RowSource
from jaxpar.ps.tables import SGD, Adagrad, Adam, TableSpec, init_rows

# The servers' side needs pyzmq, an optional dependency: imported when first named.
_SERVERS = {"Client": "client", "connect": "client", "BUCKETS": "worker", "Lookup": "worker",
            "ServerRows": "worker", "bucket_size": "worker", "lookup": "worker"}
_MODULES = ("replicas", "replica_server")     # modules of their own, named as attributes

__all__ = ["Adagrad", "Adam", "BUCKETS", "Client", "HostEmbedding", "HostRows", "Lookup", "RowOptimizer",
           "RowSource", "SGD", "ServerRows", "TableSpec", "bucket_size", "connect", "init_rows",
           "lookup"]


def __getattr__(name: str):
    module = _SERVERS.get(name, name if name in _MODULES else None)
    if module is None:      # a former name (CHANGELOG.md) is answered there; others are the usual error
        return former_attribute(__name__, name, stacklevel=2)
    try:
        import zmq  # noqa: F401  - the transport
    except ImportError as e:
        raise ImportError(f"jaxpar.ps.{name} (parameter servers, replica groups) needs pyzmq, the extra 'ps': "
                          "pip install 'jaxpar[ps]'") from e
    loaded = importlib.import_module(f"jaxpar.ps.{module}")
    return loaded if name in _MODULES else getattr(loaded, name)

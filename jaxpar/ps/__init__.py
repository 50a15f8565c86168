"""Parameter servers: embedding tables in the host memory of server processes.

Servers (``python -m jaxpar.ps.server``) own hash- or range-partitioned shards of each table
and apply the row optimizer; workers deduplicate a batch's ids, pull the rows, run the dense
model as an ordinary jitted step and push the row gradients. See docs/parameter_server.md.

Example:
    >>> spec = jaxpar.ps.TableSpec("users", 1000, 8, jaxpar.ps.Adagrad(0.1))
    >>> client = jaxpar.ps.connect([spec], addresses=["127.0.0.1:5555"], token="t")  # doctest: +SKIP
"""

try:
    import zmq  # noqa: F401  - the transport; an optional dependency
except ImportError as e:
    raise ImportError("jaxpar.ps (parameter servers) needs pyzmq, the extra 'ps': pip install 'jaxpar[ps]'") from e

from jaxpar.ps.client import Client, connect  # noqa: E402
from jaxpar.ps.tables import SGD, Adagrad, Adam, TableSpec, init_rows  # noqa: E402
from jaxpar.ps.worker import BUCKETS, Lookup, SparseTrainer, bucket_size, lookup  # noqa: E402

__all__ = ["Adagrad", "Adam", "BUCKETS", "Client", "Lookup", "SGD", "SparseTrainer", "TableSpec",
           "bucket_size", "connect", "init_rows", "lookup"]

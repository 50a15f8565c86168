"""Parameter servers: embedding tables in the host memory of server processes.

Servers (``python -m jaxpar.ps.server``) own hash- or range-partitioned shards of each table
and apply the row optimizer; workers deduplicate a batch's ids, pull the rows, run the dense
model as an ordinary jitted step and push the row gradients. See docs/parameter_server.md.

Example:
    >>> spec = jaxpar.ps.TableSpec("users", 1000, 8, jaxpar.ps.Adagrad(0.1))
    >>> client = jaxpar.ps.connect([spec], addresses=["127.0.0.1:5555"], token="t")  # doctest: +SKIP
"""

from jaxpar.ps.client import Client, connect
from jaxpar.ps.tables import SGD, Adagrad, Adam, TableSpec, init_rows
from jaxpar.ps.worker import BUCKETS, Lookup, SparseTrainer, bucket_size, lookup

__all__ = ["Adagrad", "Adam", "BUCKETS", "Client", "Lookup", "SGD", "SparseTrainer", "TableSpec",
           "bucket_size", "connect", "init_rows", "lookup"]

"""Metric writers: JSON lines (always) and TensorBoard event files (the ``tb`` extra).

A writer takes ``write(step, scalars)`` with a dict of numbers (``None`` = not measured) and
``close()``; integers (counts such as ``moe_dropped``, byte sizes) are written as integers. Each write is flushed, so a run that crashes keeps every step it logged.
"""

from __future__ import annotations

import json
import math
import numbers
import os
import time
from collections.abc import Mapping
from typing import Any

# TensorBoard groups tags by their prefix; JSON lines keep the plain keys.
PERF = ("step_time_s", "tokens_per_s", "mfu", "hfu", "flops_per_step", "checkpoint_s")


def tensorboard_tag(key: str) -> str:
    """The TensorBoard tag of a metric key: ``eval_loss`` -> ``eval/loss``, ``moe_dropped`` ->
    ``moe/dropped``, ``loss`` -> ``train/loss``.

    Example:
      >>> tensorboard_tag("memory_temp_bytes"), tensorboard_tag("tokens_per_s")
      ('memory/temp_bytes', 'perf/tokens_per_s')
    """
    for prefix in ("eval", "memory", "moe"):
        if key.startswith(prefix + "_"):
            return f"{prefix}/{key[len(prefix) + 1:]}"
    return f"perf/{key}" if key in PERF else f"train/{key}"


class JsonlWriter:
    """Writes one JSON object per logged step to ``path``: a new file, or with ``append=True``
    the end of the existing one (a resumed run). Unmeasured values are written as ``null``.

    Example:
      >>> w = JsonlWriter(os.path.join(tmp, "metrics.jsonl"))          # doctest: +SKIP
      >>> w.write(10, {"loss": 2.5, "mfu": None}); w.close()           # doctest: +SKIP
    """

    def __init__(self, path: str | os.PathLike, *, append: bool = False):
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        self.path = os.fspath(path)
        self._file = open(self.path, "a" if append else "w", encoding="utf-8")

    def write(self, step: int, scalars: Mapping[str, float | None]) -> None:
        record = {"step": int(step), "time": round(time.time(), 3), **{k: _json_value(v) for k, v in scalars.items()}}
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()      # a crash after this line keeps it

    def close(self) -> None:
        if not self._file.closed:
            self._file.close()


class TensorBoardWriter:
    """Scalars as TensorBoard event files in ``logdir``, through TensorBoard's own
    ``EventFileWriter`` (the ``tb`` extra). Unmeasured (``None``) and non-finite values are left
    out: TensorBoard plots a gap rather than a made-up number. Floats are ``simple_value``
    scalars; integers are int64 scalar tensors of the scalars plugin (as ``tf.summary.scalar``
    writes them), so a count keeps every digit where a float32 ``simple_value`` stops at 2**24.

    Example:
      >>> w = TensorBoardWriter("runs/exp1")                            # doctest: +SKIP
      >>> w.write(10, {"loss": 2.5}); w.close()                        # doctest: +SKIP
    """

    def __init__(self, logdir: str | os.PathLike):
        from tensorboard.compat.proto import event_pb2, summary_pb2, tensor_pb2, tensor_shape_pb2, types_pb2
        from tensorboard.summary.writer.event_file_writer import EventFileWriter

        self._event, self._summary = event_pb2.Event, summary_pb2.Summary
        self._int_scalar = lambda v: tensor_pb2.TensorProto(    # noqa: E731
            dtype=types_pb2.DT_INT64, tensor_shape=tensor_shape_pb2.TensorShapeProto(), int64_val=[v])
        self._int_metadata = summary_pb2.SummaryMetadata(
            plugin_data=summary_pb2.SummaryMetadata.PluginData(plugin_name="scalars"),
            data_class=summary_pb2.DATA_CLASS_SCALAR)
        self._writer = EventFileWriter(os.fspath(logdir))

    def _value(self, key: str, v):
        if isinstance(v, numbers.Integral):
            return self._summary.Value(tag=tensorboard_tag(key), tensor=self._int_scalar(int(v)),
                                       metadata=self._int_metadata)
        return self._summary.Value(tag=tensorboard_tag(key), simple_value=float(v))

    def write(self, step: int, scalars: Mapping[str, float | None]) -> None:
        values = [self._value(k, v) for k, v in scalars.items()
                  if isinstance(v, numbers.Real) and not isinstance(v, bool) and math.isfinite(v)]
        if values:
            self._writer.add_event(self._event(wall_time=time.time(), step=int(step),
                                               summary=self._summary(value=values)))
            self._writer.flush()

    def close(self) -> None:
        self._writer.close()


def read_jsonl(path: str | os.PathLike) -> list[dict[str, Any]]:
    """The records of a ``metrics.jsonl`` file (a torn last line, from a crash mid-write, is skipped).

    Example:
      >>> [r["loss"] for r in read_jsonl("runs/exp1/metrics.jsonl")]   # doctest: +SKIP
      [2.77, 2.41, 2.13]
    """
    with open(path, encoding="utf-8") as f:
        lines = f.read().splitlines()
    records = []
    for n, line in enumerate(lines, start=1):
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            if n < len(lines):      # only the last line can be torn by a crash
                raise ValueError(f"read_jsonl: line {n} of {os.fspath(path)!r} is not JSON: {line[:80]!r}") from None
    return records


def _json_value(v: Any) -> Any:
    if v is None or isinstance(v, str):
        return v
    if isinstance(v, numbers.Integral) and not isinstance(v, bool):
        return int(v)       # counts keep every digit (a float64 stops at 2**53)
    v = float(v)
    return v if math.isfinite(v) else str(v)      # JSON has no nan/inf; keep them readable

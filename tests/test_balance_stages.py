"""`jaxpar.auto.balance_stages` refuses bad stage and micro-batch counts before compiling anything."""

import pytest

from jaxpar.auto import balance_stages, module_costs
from test_pipeline_stages import _Uneven, _staged, batches


def test_microbatches_must_divide_the_batch():
    model, loss, batch = _Uneven(), _staged({".*": 0}), batches(1)[0]
    rows = batch["inputs"].shape[0]
    for microbatches in (0, 3, 2 * rows, True):
        with pytest.raises(ValueError, match=rf"microbatches={microbatches!r} must be a positive int dividing"
                                             rf".*rows \[{rows}\]"):
            module_costs(model, loss, batch, microbatches)
        with pytest.raises(ValueError, match=rf"microbatches={microbatches!r}"):
            balance_stages(model, loss, batch, 2, microbatches=microbatches)

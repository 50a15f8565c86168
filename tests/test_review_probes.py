"""Bad micro-batch counts for the stage balancer: refused with the numbers, before any module
is compiled (a count above the rows used to price empty micro-batches at zero seconds, one
that does not divide them a smaller micro-batch than the pipeline runs)."""

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

"""The optax optimizer of a job's ``optimizer`` section."""

from __future__ import annotations

import warnings

import jax
import optax

from jaxpar.job.config import OptimizerSection


def learning_rate(section: OptimizerSection, steps: int) -> optax.Schedule:
    """Linear warmup to ``lr`` over ``warmup_steps``, then cosine / linear decay to
    ``lr * min_lr_ratio`` at ``steps``, or constant. A warmup of ``steps`` or more would not end
    inside the run: it is shortened to ``steps - 1`` with a warning that says so (a short run of
    a file written for a long one, e.g. ``--train.steps 10`` over ``warmup_steps: 20``).

    >>> sched = learning_rate(OptimizerSection(lr=1.0, warmup_steps=2, schedule="linear", min_lr_ratio=0.0), 4)
    >>> [round(float(sched(i)), 2) for i in range(5)]
    [0.0, 0.5, 1.0, 0.5, 0.0]
    """
    warmup = section.warmup_steps
    if warmup and warmup >= steps:
        warmup = steps - 1
        warnings.warn(f"job config optimizer.warmup_steps={section.warmup_steps} with train.steps={steps}: the "
                      f"warmup would not end inside the run, so it is shortened to {warmup} step(s) (the rate "
                      f"reaches optimizer.lr at step {warmup}); give --optimizer.warmup_steps below {steps} to "
                      f"choose it, or --train.steps {section.warmup_steps + 1} or more", UserWarning, stacklevel=2)
    peak, end = section.lr, section.lr * section.min_lr_ratio
    if section.schedule == "constant":
        after = optax.constant_schedule(peak)
    elif section.schedule == "linear":
        after = optax.linear_schedule(peak, end, max(steps - warmup, 1))
    else:
        after = optax.cosine_decay_schedule(peak, max(steps - warmup, 1), alpha=section.min_lr_ratio)
    if warmup == 0:
        return after
    return optax.join_schedules([optax.linear_schedule(0.0, peak, warmup), after], [warmup])


def decay_mask(params):
    """Weight decay on matrices only: norm scales and biases (1-D or scalar leaves) are left out,
    as GPT-2, Llama and most recipes do."""
    return jax.tree.map(lambda p: getattr(p, "ndim", 0) >= 2, params)


def make_optimizer(section: OptimizerSection, steps: int) -> tuple[optax.GradientTransformation, optax.Schedule]:
    """``(tx, schedule)``: clipping (if ``clip_norm``) then AdamW with ``learning_rate``.

    >>> tx, sched = make_optimizer(OptimizerSection(lr=1e-3), steps=100)
    >>> round(float(sched(20)), 6)
    0.001
    """
    schedule = learning_rate(section, steps)
    adamw = optax.adamw(schedule, b1=section.b1, b2=section.b2, eps=section.eps,
                        weight_decay=section.weight_decay, mask=None if section.decay_1d else decay_mask)
    parts = ([optax.clip_by_global_norm(section.clip_norm)] if section.clip_norm is not None else []) + [adamw]
    return optax.chain(*parts), schedule

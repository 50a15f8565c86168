"""What runs around the loop, as one frozen value, and where the state lives between steps.

`Services` holds every service's small config — checkpoints (with preemption), the non-finite
policy, metrics, the profile window — and the user's own hooks; `Services.build()` turns it into
the hook objects the Trainer walks (`jaxpar.train.hooks`). Pairings are checked when the value is
built: a profile window needs metrics (its trace goes under their run directory), preemption
saves into the checkpoint directory (it is a field of `CheckpointConfig`). `Placement` says
where the state lives and how batches arrive.

>>> services = Services(checkpoint=CheckpointConfig(dir="ckpt", save_every=100),
...                     metrics=MetricsConfig(dir="runs/exp1"), profile=(10, 13))
>>> trainer = jaxpar.Trainer(model, tx, loss_fn, config, mesh, services=services)  # doctest: +SKIP
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

from jaxpar.deprecation import OFFLOAD, removed_keywords
from jaxpar.metrics import MetricsConfig, check_profile_steps

RESUME = ("newest", "newest_intact")
NONFINITE = ("stop", "skip")


class _BuiltIn:
    """Where the built-in services go among `Services.hooks` (without it: before every user hook)."""

    def __repr__(self) -> str:
        return "jaxpar.train.BUILT_IN"


BUILT_IN = _BuiltIn()


def _int(who: str, name: str, value: Any, low: int, what: str) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < low:
        raise ValueError(f"{who}: {name}={value!r} must be an int >= {low} ({what})")


@dataclasses.dataclass(frozen=True, kw_only=True)
class CheckpointConfig:
    """Checkpoints of the `TrainState` in ``dir``, and what a SIGTERM does.

    >>> CheckpointConfig(dir="ckpt", save_every=100, keep=3).resume
    'newest'
    """

    dir: str | os.PathLike
    """The checkpoint directory (created if missing); the newest complete step is resumed when
    the Trainer is built."""
    save_every: int = 0
    """Save asynchronously every ``save_every`` steps (0: only explicit ``Trainer.save()``)."""
    keep: int | None = 3
    """Keep the newest ``keep`` steps (None: all)."""
    resume: str = "newest"
    """``"newest"`` (a damaged newest step is an error naming it) or ``"newest_intact"`` (fall
    back to the newest step that reads back whole)."""
    preemption: bool = True
    """On SIGTERM, save at the next step boundary (the same step on every process) and raise
    ``jaxpar.train.Preempted`` (exit code 0), so a restart resumes exactly there."""
    local_dir: str | os.PathLike | None = None
    """The fast tier (`jaxpar.checkpoint.local`): a directory on node-local storage (e.g.
    ``/dev/shm/<run>``) where each process keeps its own shards of the newest steps, every
    ``local_every`` steps; each is copied to a peer process on another host. A restart resumes
    the newest step every process can get from there (its own copy, else the peer's), when it
    is at least as new as the persistent tier's newest."""
    local_every: int = 0
    """Save to ``local_dir`` every ``local_every`` steps (the loop waits for the device-to-host
    copy only)."""
    peer: bool = True
    """Copy each local step to a peer process (of another host, when there are several)."""

    def __post_init__(self):
        if not isinstance(self.dir, (str, os.PathLike)) or not os.fspath(self.dir):
            raise TypeError(f"CheckpointConfig: dir={self.dir!r} must be a non-empty path, e.g. dir='ckpt'")
        _int("CheckpointConfig", "save_every", self.save_every, 0, "0 = only explicit saves")
        if self.keep is not None:
            _int("CheckpointConfig", "keep", self.keep, 1, "or None to keep every step")
        if self.resume not in RESUME:
            raise ValueError(f"CheckpointConfig: resume={self.resume!r}; choose one of {RESUME}")
        if not isinstance(self.preemption, bool):
            raise TypeError(f"CheckpointConfig: preemption={self.preemption!r} must be True or False")
        _int("CheckpointConfig", "local_every", self.local_every, 0, "0 = no local tier")
        if self.local_dir is not None and (not isinstance(self.local_dir, (str, os.PathLike))
                                           or not os.fspath(self.local_dir)):
            raise TypeError(f"CheckpointConfig: local_dir={self.local_dir!r} must be a non-empty path on node-local "
                            "storage, e.g. local_dir='/dev/shm/run1'")
        if self.local_every and self.local_dir is None:
            raise ValueError(f"CheckpointConfig: local_every={self.local_every} saves into local_dir, and none was "
                             "given; pass local_dir= (node-local storage, e.g. '/dev/shm/run1')")
        if self.local_dir is not None and not self.local_every:
            raise ValueError(f"CheckpointConfig: local_dir={os.fspath(self.local_dir)!r} with local_every=0 keeps "
                             "nothing there; pass local_every=N (save there every N steps), or drop local_dir")
        if not isinstance(self.peer, bool):
            raise TypeError(f"CheckpointConfig: peer={self.peer!r} must be True or False")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Services:
    """The services around a Trainer's loop, each built into one hook (`build`).

    >>> Services(nonfinite="skip").build()        # doctest: +SKIP
    [NonfiniteHook('skip')]
    """

    checkpoint: CheckpointConfig | None = None
    """Periodic checkpoints, resume, and (``preemption``) the save on SIGTERM."""
    nonfinite: str = "stop"
    """A step whose loss or gradient is not finite: ``"stop"`` raises ``FloatingPointError``
    naming it when the flags are next read (before every save, at logging, every 100 steps), and
    a save refuses a state holding a non-finite parameter (a finite step's NaN update: a
    ``FloatingPointError`` naming the step and the leaves), so neither reaches a checkpoint;
    ``"skip"`` keeps the previous state when the loss, the gradient or the update it writes is not
    finite, and counts the step in ``trainer.skipped_steps``."""
    metrics: MetricsConfig | None = None
    """Metric writers (`jaxpar.metrics.MetricsConfig`): a loop over ``step`` logs every
    ``metrics.every`` steps, as ``fit`` does, and ``evaluate`` its loss."""
    profile: tuple[int, int] | str | None = None
    """A ``jax.profiler`` trace of steps ``start`` to ``stop - 1`` (``(10, 13)`` or ``"10:13"``)
    under ``metrics.dir/profile``; needs ``metrics``."""
    hooks: tuple = ()
    """The user's hook objects (`jaxpar.train.Hook`), walked in this order after the built-in ones,
    or around them where the tuple holds `BUILT_IN` (``hooks=(early, BUILT_IN, late)``)."""

    def __post_init__(self):
        if self.checkpoint is not None and not isinstance(self.checkpoint, CheckpointConfig):
            raise TypeError(f"Services: checkpoint must be a jaxpar.CheckpointConfig, got "
                            f"{type(self.checkpoint).__name__}; e.g. checkpoint=CheckpointConfig(dir='ckpt')")
        if self.nonfinite not in NONFINITE:
            raise ValueError(f"Services: nonfinite={self.nonfinite!r}; choose 'stop' (raise naming the step) or "
                             "'skip' (count the skipped updates and go on)")
        if self.metrics is not None and not isinstance(self.metrics, MetricsConfig):
            raise TypeError(f"Services: metrics must be a jaxpar.metrics.MetricsConfig, got "
                            f"{type(self.metrics).__name__}; e.g. metrics=MetricsConfig(dir='runs/exp1')")
        try:
            window = check_profile_steps(self.profile)
        except (TypeError, ValueError) as e:
            raise type(e)(f"Services: profile={self.profile!r}: {e}") from None
        if window is not None and self.metrics is None:
            raise ValueError(f"Services: profile={window} writes its trace under the run directory; pass "
                             "metrics=MetricsConfig(dir=...) as well")
        object.__setattr__(self, "profile", window)
        hooks = tuple(self.hooks) if isinstance(self.hooks, (list, tuple)) else None
        if hooks is None:
            raise TypeError(f"Services: hooks={self.hooks!r} must be a tuple of hook objects")
        for hook in hooks:
            if hook is not BUILT_IN and not any(callable(getattr(hook, m, None)) for m in HOOK_METHODS):
                raise TypeError(f"Services: hooks holds {hook!r}, which has none of {HOOK_METHODS}; subclass "
                                "jaxpar.train.Hook, or add a function with Trainer.add_hook(fn, every=N)")
        if sum(h is BUILT_IN for h in hooks) > 1:
            raise ValueError("Services: hooks holds BUILT_IN more than once; place the built-in services once")
        object.__setattr__(self, "hooks", hooks)

    def build(self) -> list:
        """The hook objects, in the order the Trainer walks them: the profile window (its step
        marker covers the dispatch alone), the non-finite read (every step's flag is recorded
        before anything saves), preemption (a preempted step is saved and the run leaves before
        anything else), periodic checkpoints, metrics; the user's hooks after them, or around
        them at `BUILT_IN`. Opens what the services hold (the checkpoint directory, the SIGTERM
        handler); a failure closes them again."""
        from jaxpar.train.checkpointing import CheckpointHook
        from jaxpar.train.hooks import NonfiniteHook, PreemptionHook
        from jaxpar.train.watch import MetricsHook, ProfileHook

        built: list = []
        try:
            if self.metrics is not None and self.profile is not None:     # its step marker wraps the dispatch alone
                built.append(ProfileHook(self.metrics.profile_dir, self.profile))
            built.append(NonfiniteHook(self.nonfinite))
            if self.checkpoint is not None:
                checkpoint = CheckpointHook(self.checkpoint)     # a bad directory is refused before SIGTERM is taken
                if self.checkpoint.preemption:
                    built.append(PreemptionHook())
                built.append(checkpoint)
            if self.metrics is not None:
                built.append(MetricsHook(self.metrics))
        except BaseException:
            for hook in built:
                hook.on_close(None)
            raise
        if BUILT_IN not in self.hooks:
            return built + list(self.hooks)
        at = self.hooks.index(BUILT_IN)
        return list(self.hooks[:at]) + built + list(self.hooks[at + 1:])


HOOK_METHODS = ("on_start", "before_step", "after_step", "on_close")


@removed_keywords("Placement", {"offload": lambda _: OFFLOAD}, error=ValueError)   # host offload: removed
@dataclasses.dataclass(frozen=True, kw_only=True)
class Placement:
    """Where the state lives between steps and how batches arrive.

    >>> Placement(donate=False).donate
    False
    """

    donate: bool = True
    """The step reuses the state's device buffers (the model's arrays are the Trainer's from then on)."""
    global_batch: bool | None = None
    """Batches hold every process's rows (None: only in a run of one process); else each process
    passes its own rows."""
    replicas: Any = None
    """A replica group (`jaxpar.ps.replicas.connect()`): this job is one of several data-parallel
    copies that average their gradients every step through a coordinator, keep training when
    one dies, and heal one that comes back from a live one (docs/reliability.md)."""

    def __post_init__(self):
        if not isinstance(self.donate, bool):
            raise TypeError(f"Placement: donate={self.donate!r} must be True or False")
        if self.global_batch is not None and not isinstance(self.global_batch, bool):
            raise TypeError(f"Placement: global_batch={self.global_batch!r} must be True, False or None")


# ------------------------------------------------------------------ former keywords
CHECKPOINT_KEYWORDS = {"save_every": 0, "keep": 3, "resume": "newest", "preemption": True}   # 0.1.0's defaults
SERVICE_KEYWORDS = ("checkpoint_dir", *CHECKPOINT_KEYWORDS, "nonfinite", "metrics", "profile_steps")
PLACEMENT_KEYWORDS = ("donate", "global_batch")


def former_keywords(init):
    """``Trainer.__init__`` accepting the flat keywords of 0.1.0 for one release: each warns naming
    its new spelling (`jaxpar.deprecation.KEYWORDS`) and is folded into ``services=``,
    ``placement=`` or (``example_batch``) ``plan=``. The signature lists them, keyword-only."""
    import functools
    import inspect

    from jaxpar.deprecation import KEYWORDS, Removed, refusal, warn_renamed

    entries = KEYWORDS["Trainer"]

    @functools.wraps(init)
    def __init__(self, *args, **kwargs):
        former = {k: kwargs.pop(k) for k in list(kwargs) if k in entries}
        for k in former:
            if isinstance(entries[k], Removed):     # offload=: host offload was removed
                raise ValueError(refusal(f"Trainer({k}={former[k]!r})", entries[k]))
            warn_renamed(f"Trainer({k}=...)", entries[k], stacklevel=2)
        if former:
            kwargs = _fold(former, kwargs, args)
        init(self, *args, **kwargs)

    sig = inspect.signature(init)
    extra = [inspect.Parameter(k, inspect.Parameter.KEYWORD_ONLY, default=None) for k in entries]
    __init__.__signature__ = sig.replace(parameters=[*sig.parameters.values(), *extra])
    return __init__


def _fold(former: dict, kwargs: dict, args: tuple) -> dict:
    """The Trainer's keywords with the former ones folded into their values."""
    for group, name in ((SERVICE_KEYWORDS, "services"), (PLACEMENT_KEYWORDS, "placement")):
        given = [k for k in group if k in former]
        if given and kwargs.get(name) is not None:
            raise TypeError(f"Trainer: both {name}= and the former keywords {given} are given; keep only {name}= "
                            f"(move {', '.join(f'{k}=' for k in given)} into it, see CHANGELOG.md)")
    if any(k in former for k in SERVICE_KEYWORDS):
        checkpoint = None
        loose = {k: former[k] for k in CHECKPOINT_KEYWORDS if k in former}
        if former.get("checkpoint_dir") is not None:
            checkpoint = CheckpointConfig(dir=former["checkpoint_dir"], **loose)
        else:
            wants = {k: v for k, v in loose.items() if v != CHECKPOINT_KEYWORDS[k]}
            if wants:
                raise ValueError(f"Trainer: {', '.join(f'{k}={v!r}' for k, v in wants.items())} without "
                                 "checkpoint_dir=: they save into a checkpoint directory, and none was given; "
                                 "pass services=jaxpar.Services(checkpoint=jaxpar.CheckpointConfig(dir=..., "
                                 f"{', '.join(f'{k}={v!r}' for k, v in wants.items())}))")
        kwargs["services"] = Services(checkpoint=checkpoint, nonfinite=former.get("nonfinite", "stop"),
                                      metrics=former.get("metrics"), profile=former.get("profile_steps"))
    if any(k in former for k in PLACEMENT_KEYWORDS):
        kwargs["placement"] = Placement(donate=former.get("donate", True), global_batch=former.get("global_batch"))
    batch = former.get("example_batch")
    config = args[3] if len(args) > 3 else kwargs.get("config")
    if batch is not None and kwargs.get("plan") is None and getattr(config, "mode", None) == "auto":
        from jaxpar.deprecation import resolve

        model, tx, loss_fn, _, mesh = (list(args) + [kwargs.get(k) for k in ("model", "tx", "loss_fn", "config",
                                                                             "mesh")][len(args):])[:5]
        # the search lives in jaxpar.auto, after this package in the data flow: reached by name, as
        # the deprecation table reaches every replacement, for this former keyword's release only
        plan_for = resolve("jaxpar.auto:plan_for")
        kwargs["plan"] = plan_for(model, _as_transformation(tx), loss_fn, config, mesh, example_batch=batch)
    return kwargs


def _as_transformation(tx):
    import optax

    return tx.gradient_transformation() if isinstance(tx, optax.MultiSteps) else tx

"""Resolve: the settings as given -> one resolved run, before anything is built.

``--plan auto`` fills what the user did not give from the data's fingerprint (rank 0 plans and
broadcasts, or a resumed run keeps its own plan), ``app.precision.auto`` decides the ``auto``
precision and memory format, and the plan's samples per volume are fitted to the step the probe
measured. The result, :class:`ResolvedRun`, is the only configuration the trainer reads (``cfg``);
it keeps the settings as given for ``config.yaml`` and the reasons of every choice.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from app.config import Config, ConfigError
from app.data.dataset import DataError
from app.data.volume_io import VolumeError
from app.distributed import DistEnv, broadcast_object, run_on_primary
from app.engine.checkpoint import load_checkpoint, resume_path
from app.engine.compiling import CompileDecision
from app.engine.preflight import check_data_root, check_output_dir
from app.plan import REFIT_EPOCH, Plan, apply_plan, plan_for
from app.precision.auto import Decision, decide

log = logging.getLogger("app.train")


@dataclass
class ResolvedRun:
    """One run, resolved: ``cfg`` is what everything reads; ``settings`` is the same run with
    its ``auto`` values as given (what ``config.yaml`` records, so that it can be passed back
    as ``--config``); ``given`` are the settings the user set, which the plan keeps."""

    settings: Config
    cfg: Config
    given: frozenset[str]
    decision: Decision
    plan: Plan | None
    resume_from: Path | None
    resumed: dict[str, Any] | None  # the checkpoint resumed from, as loaded
    compiled: CompileDecision | None = None  # --compile, decided once the data is loaded

    @property
    def reasons(self) -> dict[str, Any]:
        """Why each ``auto`` setting is what it is (``resolved:`` in ``config.yaml``)."""
        reasons = self.decision.to_dict() | ({"plan": self.plan.reasons} if self.plan else {})
        return reasons | ({"compile": self.compiled.to_dict()} if self.compiled else {})

    def refit_plan(self, train_time: float, epoch: int) -> bool:
        """After ``REFIT_EPOCH``: the plan's samples per volume refitted so that the epochs left
        fill ``--plan-budget-s`` (rank 0's epoch time, so that every rank draws the same
        patches); returns whether anything changed. Called on every rank."""
        if self.plan is None or epoch != REFIT_EPOCH:
            return False
        train_time = broadcast_object(train_time)
        budget = self.settings.plan_budget_s
        if self.plan.fit_to_epoch(train_time, epoch, budget, self.given) is None:
            return False
        log.info("--plan auto: samples_per_volume %s", self.plan.reasons["samples_per_volume"])
        self.settings = apply_plan(self.settings, self.given, self.plan)
        self.cfg = dataclasses.replace(
            self.cfg, samples_per_volume=self.settings.samples_per_volume
        )
        return True


def resolve(settings: Config, given: frozenset[str], env: DistEnv) -> ResolvedRun:
    """Check the run dir and data, find the checkpoint to resume, plan, and decide ``auto``."""
    run_on_primary((ConfigError, DataError), preflight, settings)
    # decided on the primary rank so that every rank resumes from the same file
    resume_from = broadcast_object(
        resume_path(settings.resume, settings.run_dir) if env.is_primary else None
    )
    if settings.eval_only and resume_from is None:
        raise ConfigError(
            f"--eval-only needs a checkpoint: {settings.run_dir}/checkpoints/last.pt does "
            "not exist; pass --resume PATH or the --output-dir of a trained run"
        )
    resumed = load_checkpoint(resume_from) if resume_from is not None else None
    settings, plan = planned(settings, given, env, resumed)
    decision = decide(settings, env, resumed)
    if env.is_primary:
        log.info("%s", decision.log_line())
    if plan is not None and resumed is None:
        settings = fit_plan_to_step(plan, settings, given, decision, env)
    cfg = decision.apply(settings)
    return ResolvedRun(settings, cfg, given, decision, plan, resume_from, resumed)


def preflight(settings: Config) -> None:
    check_output_dir(settings.run_dir)
    check_data_root(Path(settings.data_root))


def planned(
    settings: Config, given: frozenset[str], env: DistEnv, resumed: dict[str, Any] | None
) -> tuple[Config, Plan | None]:
    """``settings`` with ``--plan auto`` applied to what was not given: planned on rank 0 and
    broadcast, or a resumed run's own plan (a new one could differ, and its weights would not
    fit)."""
    if settings.plan != "auto":
        return settings, None
    saved = (resumed or {}).get("plan")
    if saved:
        plan = Plan(**saved)
    else:
        result: Plan | str | None = None
        if env.is_primary:
            try:
                processes = int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1)
                result = plan_for(settings, given, env.device, processes)
            except (DataError, VolumeError) as exc:
                result = str(exc)
        result = broadcast_object(result)
        if isinstance(result, str):  # every rank stops with the same message
            raise DataError(f"--plan auto: {result}")
        plan = result
    if env.is_primary:
        kept = sorted(given & set(plan.values))
        log.info(
            "--plan auto (%s)%s:\n%s",
            "the resumed run's plan" if saved else f"for {settings.plan_budget_s:g} s",
            f", keeping the given {', '.join(kept)}" if kept else "",
            plan.describe(),
        )
    return apply_plan(settings, given, plan), plan


def fit_plan_to_step(
    plan: Plan, settings: Config, given: frozenset[str], decision: Decision, env: DistEnv
) -> Config:
    """The plan's samples per volume rescaled to the step the precision probe measured (the
    same figures on every rank: the decision is broadcast)."""
    if decision.step_s is None or plan.fit_to_step(decision.step_s, given) is None:
        return settings
    if env.is_primary:
        log.info("--plan auto: samples_per_volume %s", plan.reasons["samples_per_volume"])
    return apply_plan(settings, given, plan)

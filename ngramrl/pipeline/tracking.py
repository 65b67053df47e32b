"""Experiment tracking: wandb (offline unless configured otherwise) plus a JSON-lines log.

A tracking failure never stops training: wandb problems are logged once and tracking goes on
in ``metrics.jsonl`` alone.
"""

from __future__ import annotations

import json
import logging
import os
from typing import Any

from ngramrl.paths import cut_torn_tail
from ngramrl.pipeline.config import TrackingSection

logger = logging.getLogger(__name__)


class Tracker:
    def __init__(self, config: TrackingSection, run_config: dict[str, Any], output_dir: str,
                 append: bool = False) -> None:
        """``append``: a resumed run's records follow the earlier run's in ``metrics.jsonl``."""
        self.path = os.path.join(output_dir, "metrics.jsonl")
        self.directory: str | None = None
        self.run: Any = None
        with open(self.path, "ab+" if append else "wb") as handle:
            # a run killed while writing a record left a torn last line: the next record would join it
            cut = cut_torn_tail(handle) if append else 0
        if cut:
            logger.warning("%s: the last line was torn (the run was stopped writing it); its %d bytes are cut off",
                           self.path, cut)
        if config.wandb == "disabled":
            return
        try:
            import wandb

            os.environ.setdefault("WANDB_SILENT", "true")
            self.run = wandb.init(project=config.project, name=config.run_name, config=run_config, mode=config.wandb,
                                  dir=output_dir, reinit="finish_previous")
            self.directory = getattr(self.run, "dir", None)
        except Exception as err:  # noqa: BLE001 - tracking must not break a run
            logger.warning("wandb is unavailable (%s); metrics go to %s only", err, self.path)
            self.run = None

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        with open(self.path, "a") as handle:
            handle.write(json.dumps({"step": step, **metrics}) + "\n")
        if self.run is not None:
            try:
                self.run.log(metrics, step=step)
            except Exception as err:  # noqa: BLE001
                logger.warning("wandb log failed (%s); continuing with %s", err, self.path)
                self.run = None

    def log_report(self, image_path: str, summary: dict[str, Any]) -> None:
        """The run report: its picture, and its headline numbers as the run's summary."""
        if self.run is None:
            return
        try:
            import wandb

            self.run.log({"report": wandb.Image(image_path)})
            for key, value in summary.items():
                if isinstance(value, (int, float)):
                    self.run.summary[key] = value
        except Exception as err:  # noqa: BLE001
            logger.warning("wandb could not take the report (%s); it is at %s", err, image_path)

    def finish(self) -> None:
        if self.run is not None:
            try:
                self.run.finish()
            except Exception:  # noqa: BLE001
                pass
            self.run = None

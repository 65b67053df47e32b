"""A drafter shard's journal: the finished rollouts it took since its last snapshot, on disk.

A shard is fed by whoever finishes rollouts: the training loop's driver, or (with OpenRLHF) the
engines themselves. Writing each batch to a file beside the shard's snapshot before taking it
means a shard that dies is rebuilt from its snapshot plus its journal, whoever fed it, with
nothing held elsewhere. A snapshot empties the journal; a torn last line (the shard died while
writing it) is left out.
"""

from __future__ import annotations

import json
import logging
import os

logger = logging.getLogger(__name__)

Record = tuple[str, list[int], list[int], int]  # (prompt id, prompt, output, epoch)


class RolloutJournal:
    def __init__(self, path: str) -> None:
        self.path = path

    def append(self, records: list[Record]) -> None:
        """Add a batch of rollouts (one line, flushed before the shard takes them)."""
        if not records:
            return
        os.makedirs(os.path.dirname(os.path.abspath(self.path)), exist_ok=True)
        line = json.dumps([[prompt_id, list(prompt), list(output), int(epoch)]
                           for prompt_id, prompt, output, epoch in records], separators=(",", ":"))
        with open(self.path, "a", encoding="utf-8") as handle:
            handle.write(line + "\n")
            handle.flush()

    def read(self) -> list[Record]:
        """Every rollout written since the last reset, in order."""
        if not os.path.exists(self.path):
            return []
        records: list[Record] = []
        with open(self.path, encoding="utf-8") as handle:
            lines = handle.read().split("\n")
        for number, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                batch = json.loads(line)
            except ValueError:
                if number == len(lines) or all(not rest.strip() for rest in lines[number:]):
                    logger.warning("%s: line %d is torn (the shard died writing it); left out", self.path, number)
                    break
                raise ValueError(f"{self.path}: line {number} is not a journal entry") from None
            records.extend((str(p), list(prompt), list(output), int(epoch)) for p, prompt, output, epoch in batch)
        return records

    def reset(self) -> None:
        """A snapshot now holds everything: start an empty journal."""
        if os.path.exists(self.path):
            os.remove(self.path)

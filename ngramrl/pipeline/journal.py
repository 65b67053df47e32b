"""A drafter shard's journal: the finished rollouts it took since its last snapshot, on disk.

A shard is fed by whoever finishes rollouts: the training loop's driver, or (with OpenRLHF) the
engines themselves. Writing each batch to a file beside the shard's snapshot before taking it
means a shard that dies is rebuilt from its snapshot plus its journal, whoever fed it, with
nothing held elsewhere. A snapshot empties the journal. A torn last line (the shard died while
writing it) is left out by ``read`` and cut off by the next ``append``, so the batches written
after it stay lines of their own.
"""

from __future__ import annotations

import json
import logging
import os

from ngramrl.paths import cut_torn_tail

logger = logging.getLogger(__name__)

Record = tuple[str, list[int], list[int], int]  # (prompt id, prompt, output, epoch)

# Every batch line starts so (a list of records whose first field is a JSON string); inside a
# line it cannot occur, since a record's other fields are flat lists of ints and a quote inside a
# string is escaped.
BATCH_START = '[["'


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
        with open(self.path, "ab+") as handle:
            # a write cut short (the shard died in it) would join the batch written after it
            cut = cut_torn_tail(handle)
            if cut:
                logger.warning("%s: the last line is torn (the shard died writing it); its %d bytes are cut off",
                               self.path, cut)
            handle.write(line.encode("utf-8") + b"\n")
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
                batch = batch_after_torn_write(line)
                if batch is not None:
                    logger.warning("%s: line %d starts with a torn write (the shard died writing it) that the next "
                                   "batch was written after; the torn part is left out", self.path, number)
                elif number == len(lines) or all(not rest.strip() for rest in lines[number:]):
                    logger.warning("%s: line %d is torn (the shard died writing it); left out", self.path, number)
                    break
                else:
                    raise ValueError(f"{self.path}: line {number} is not a journal entry") from None
            records.extend((str(p), list(prompt), list(output), int(epoch)) for p, prompt, output, epoch in batch)
        return records

    def reset(self) -> None:
        """A snapshot now holds everything: start an empty journal."""
        if os.path.exists(self.path):
            os.remove(self.path)


def batch_after_torn_write(line: str) -> list | None:
    """The whole batch ending ``line`` when a torn write precedes it on the line (a batch appended
    to a journal whose torn tail was not cut off), else None."""
    start = line.rfind(BATCH_START, 1)
    if start < 0:
        return None
    try:
        batch = json.loads(line[start:])
    except ValueError:
        return None
    return batch if isinstance(batch, list) else None

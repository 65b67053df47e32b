import shutil

import pytest

import ngramrl.paths as paths_module
from ngramrl.config import NgramRLConfig
from ngramrl.pipeline.journal import RolloutJournal
from ngramrl.pipeline.pool import DrafterShard, journal_path, snapshot_path


def test_the_journal_reads_back_what_it_took_and_leaves_out_a_torn_last_line(tmp_path):
    journal = RolloutJournal(str(tmp_path / "j.jsonl"))
    journal.append([("p", [1, 2], [3, 4], 0)])
    journal.append([("q", [5], [6], 1), ("p", [1, 2], [7], 1)])
    assert journal.read() == [("p", [1, 2], [3, 4], 0), ("q", [5], [6], 1), ("p", [1, 2], [7], 1)]
    with open(journal.path, "a") as handle:
        handle.write('[["p",[1,2],[8')  # the shard died writing it
    assert len(journal.read()) == 3
    with open(journal.path, "a") as handle:
        handle.write("\n" + '[["r",[1],[2],0]]' + "\n")
    with pytest.raises(ValueError, match="line 3 is not a journal entry"):
        journal.read()
    journal.reset()
    assert journal.read() == []


def test_batches_appended_after_a_torn_last_line_are_kept_and_the_fragment_is_cut_off(tmp_path, monkeypatch):
    """A shard that died writing a batch leaves a torn last line; the rebuilt shard appends to the
    same journal. Its batches stay lines of their own: every later read (a rebuild, a resume) gets
    every complete batch."""
    monkeypatch.setattr(paths_module, "TAIL_CHUNK", 4)  # the look back for the last newline spans chunks
    journal = RolloutJournal(str(tmp_path / "j.jsonl"))
    journal.append([("p", [1, 2], [3, 4], 0)])
    journal.append([("q", [5], [6], 1)])
    with open(journal.path, "a") as handle:
        handle.write('[["p",[1,2],[8')  # the shard died writing it
    journal.append([("r", [1], [2], 1)])
    journal.append([("p", [1, 2], [9], 2), ("s", [3], [4], 2)])
    assert journal.read() == [("p", [1, 2], [3, 4], 0), ("q", [5], [6], 1), ("r", [1], [2], 1),
                              ("p", [1, 2], [9], 2), ("s", [3], [4], 2)]
    with open(journal.path) as handle:
        assert "[8" not in handle.read()  # the fragment is gone, not kept as a line of garbage
    torn_alone = RolloutJournal(str(tmp_path / "alone.jsonl"))
    with open(torn_alone.path, "w") as handle:
        handle.write('[["p",[1')  # torn in the journal's first write
    torn_alone.append([("q", [5], [6], 0)])
    assert torn_alone.read() == [("q", [5], [6], 0)]


def test_a_batch_written_straight_after_a_torn_write_is_read_back(tmp_path):
    """A journal where a batch was appended to a torn line without a newline between them (its
    torn tail was not cut off) still reads: the complete batch is kept, the torn part left out."""
    journal = RolloutJournal(str(tmp_path / "j.jsonl"))
    with open(journal.path, "w") as handle:
        handle.write('[["p",[1,2],[3,4],0]]\n' + '[["p",[1,2],[8' + '[["r",[1],[2],1]]\n'
                     + '[["q",[5],[6],1]]\n' + '[["s",[3],[4')
    assert journal.read() == [("p", [1, 2], [3, 4], 0), ("r", [1], [2], 1), ("q", [5], [6], 1)]


def test_a_shard_rebuilt_from_its_snapshot_and_journal_drafts_as_before(tmp_path):
    snapshot = snapshot_path(str(tmp_path), 0)
    shard = DrafterShard(0, NgramRLConfig(), (99,), journal=journal_path(snapshot))
    shard.add_rollouts([("p", [1, 2, 3], [10, 11, 12, 13, 99], 0)])
    shard.save(snapshot)
    shard.add_rollouts([("p", [1, 2, 3], [10, 11, 20, 21, 22, 99], 1)])  # after the save: journaled
    expected = shard.lookup("p", [1, 2, 3], [10, 11], 4)
    assert expected[0] == [20, 21, 22, 99]
    rebuilt = DrafterShard(0, NgramRLConfig(), (99,), journal=journal_path(snapshot))
    rebuilt.load(snapshot)
    assert rebuilt.lookup("p", [1, 2, 3], [10, 11], 4) == expected
    bare = tmp_path / "bare"
    bare.mkdir()
    shutil.copy(snapshot, bare / "shard-0.json.gz")
    lost = DrafterShard(0, NgramRLConfig(), (99,))
    lost.load(str(bare / "shard-0.json.gz"))  # without its journal only the saved epoch is known
    assert lost.lookup("p", [1, 2, 3], [10, 11], 4)[0] == [12, 13, 99]
    unsaved = DrafterShard(0, NgramRLConfig(), (99,), journal=str(tmp_path / "other.journal.jsonl"))
    unsaved.add_rollouts([("p", [1, 2, 3], [10, 11, 30, 99], 0)])
    again = DrafterShard(0, NgramRLConfig(), (99,), journal=str(tmp_path / "other.journal.jsonl"))
    assert again.replay_journal() == 1 and again.lookup("p", [1, 2, 3], [10, 11], 4)[0] == [30, 99]

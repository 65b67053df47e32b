import gzip
import json
import os
import zlib

import pytest

from ngramrl.core.trace import Rollout, TraceError, TraceHeader, model_vocab_size, read_trace, write_trace

HEADER = {"ngramrl_trace": 1, "vocab_size": 100, "eos_token_ids": [2], "workload": "toy"}
TRACE_HEADER = TraceHeader(vocab_size=100, eos_token_ids=[2], workload="toy")


def write_lines(path, lines):
    path.write_text("".join(line + "\n" for line in lines))
    return str(path)


def rollout_line(**overrides):
    obj = {"prompt_id": "a", "epoch": 0, "sample": 0, "prompt": [1, 5], "output": [7, 2]}
    obj.update(overrides)
    return json.dumps(obj)


def test_round_trip_gzip_and_sorting(tmp_path):
    header = TraceHeader(vocab_size=50, eos_token_ids=[2], model="m", workload="w", temperature=0.6,
                         extra={"custom": 1})
    rollouts = [Rollout("b", 1, 0, [1], [3, 2], "stop"), Rollout("a", 0, 1, [4], [5], "length", reward=0.5),
                Rollout("a", 0, 0, [4], [], None)]
    path = str(tmp_path / "t.jsonl.gz")
    write_trace(path, header, rollouts)
    trace = read_trace(path)
    assert [(r.epoch, r.prompt_id, r.sample) for r in trace.rollouts] == [(0, "a", 0), (0, "a", 1), (1, "b", 0)]
    assert trace.header.extra == {"custom": 1} and trace.header.temperature == 0.6
    assert trace.rollouts[1].reward == 0.5 and trace.workload == "w"
    with gzip.open(path, "rt") as handle:
        assert json.loads(handle.readline())["ngramrl_trace"] == 1


@pytest.mark.parametrize("name, workload", [("spider-qwen.jsonl", "spider-qwen"),
                                             ("gsm-smollm2-t0.6.jsonl", "gsm-smollm2-t0.6"),
                                             ("run.v2", "run.v2")])
def test_workload_falls_back_to_file_name_without_its_extensions(tmp_path, name, workload):
    header = dict(HEADER)
    del header["workload"]
    path = write_lines(tmp_path / name, [json.dumps(header), rollout_line()])
    assert read_trace(path).workload == workload


@pytest.mark.parametrize(
    "lines, line_no, needle",
    [
        ([json.dumps(HEADER), "{not json"], 2, "not JSON"),
        ([json.dumps(HEADER), json.dumps({"prompt_id": "a", "epoch": 0, "sample": 0, "prompt": [1]})], 2,
         "missing required field 'output'"),
        ([json.dumps(HEADER), rollout_line(output=[7, 100])], 2, "out of range"),
        ([json.dumps(HEADER), rollout_line(output=[7, -1])], 2, "out of range"),
        ([json.dumps(HEADER), rollout_line(epoch=1), rollout_line(epoch=0, sample=1)], 3, "epoch goes backwards"),
        ([json.dumps(HEADER), rollout_line(), rollout_line(sample=1, prompt=[1, 6])], 3, "different prompt tokens"),
        ([json.dumps(HEADER), rollout_line(epoch=-1)], 2, "'epoch' must be an integer >= 0"),
        ([json.dumps(HEADER), rollout_line(), rollout_line(sample=1), rollout_line(output=[8])], 4,
         "rollout (prompt_id 'a', epoch 0, sample 0) appears twice (first on line 2)"),
        ([json.dumps(HEADER), rollout_line(finish_reason="eos")], 2, "finish_reason"),
        ([json.dumps(HEADER), rollout_line(prompt_id=3)], 2, "'prompt_id' must be a string"),
        ([json.dumps(HEADER), rollout_line(output=[1.5])], 2, "not an integer"),
        ([json.dumps(HEADER), ""], 2, "empty line"),
        ([json.dumps({"vocab_size": 10, "eos_token_ids": [1]})], 1, "missing 'ngramrl_trace'"),
        ([json.dumps({**HEADER, "ngramrl_trace": 2})], 1, "unsupported trace version"),
        ([json.dumps({**HEADER, "ngramrl_trace": True})], 1, "unsupported trace version"),
        ([json.dumps(HEADER), rollout_line(reward=float("nan"))], 2, "'reward' must be a number, got nan"),
        ([json.dumps({**HEADER, "temperature": float("inf")})], 1, "'temperature' must be a number"),
        ([json.dumps({**HEADER, "vocab_size": 0})], 1, "vocab_size"),
        ([json.dumps({**HEADER, "vocab_size": 2**31 + 1})], 1, "vocab_size' must be at most 2^31, got 2147483649"),
        ([json.dumps({**HEADER, "eos_token_ids": 2})], 1, "eos_token_ids"),
    ],
)
def test_bad_input_names_file_line_and_problem(tmp_path, lines, line_no, needle):
    path = write_lines(tmp_path / "bad.jsonl", lines)
    with pytest.raises(TraceError) as info:
        read_trace(path)
    assert info.value.path == path
    assert info.value.line == line_no
    assert needle in str(info.value)
    assert str(info.value).startswith(f"{path}:{line_no}:")


def test_a_gzip_file_named_as_plain_text_says_so(tmp_path):
    path = tmp_path / "rollouts.jsonl"
    path.write_bytes(gzip.compress((json.dumps(HEADER) + "\n" + rollout_line() + "\n").encode()))
    with pytest.raises(TraceError, match="the file is gzip-compressed: name it .jsonl.gz"):
        read_trace(str(path))


def test_empty_and_unreadable_files(tmp_path):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    with pytest.raises(TraceError, match="empty"):
        read_trace(str(empty))
    broken = tmp_path / "broken.jsonl.gz"
    broken.write_bytes(b"not gzip at all")
    with pytest.raises(TraceError, match="cannot read"):
        read_trace(str(broken))


def test_a_trace_that_ends_in_the_middle_of_an_append_says_so(tmp_path):
    """A run's trace read while the run appends to it (or after it was stopped mid-append) ends
    inside a gzip member: the error says so and what cuts the torn end off."""
    import gzip

    path = tmp_path / "live.jsonl.gz"
    good = "".join(line + "\n" for line in [json.dumps(HEADER), rollout_line()]).encode()
    path.write_bytes(gzip.compress(good) + gzip.compress(rollout_line(sample=1).encode() + b"\n")[:25])
    with pytest.raises(TraceError, match="ends in the middle of an append .*ngramrl train --resume"):
        read_trace(str(path))


def test_a_gzip_stream_damaged_past_its_header_is_a_read_error_naming_the_file(tmp_path):
    good = "".join(line + "\n" for line in [json.dumps(HEADER), rollout_line(), rollout_line(sample=1)])
    packer = zlib.compressobj(wbits=31)  # a gzip stream
    data = packer.compress(good.encode()) + packer.flush(zlib.Z_FULL_FLUSH)
    path = tmp_path / "damaged.jsonl.gz"
    path.write_bytes(data + b"\x07\x00\x00\x00")  # then a deflate block of the reserved type 3
    with pytest.raises(TraceError) as info:
        read_trace(str(path))
    assert str(info.value).startswith(f"{path}: cannot read file: corrupt gzip data (")
    assert info.value.line is None


def test_a_file_level_error_names_no_line(tmp_path):
    broken = tmp_path / "broken.jsonl.gz"
    broken.write_bytes(b"not gzip at all")
    with pytest.raises(TraceError) as info:
        read_trace(str(broken))
    assert str(info.value).startswith(f"{broken}: cannot read file: ") and info.value.line is None


def test_a_trace_is_never_written_with_numbers_strict_json_lacks(tmp_path):
    rollout = Rollout("a", 0, 0, [1], [2], "stop", reward=float("nan"))
    with pytest.raises(ValueError):
        write_trace(str(tmp_path / "nan.jsonl"), TraceHeader(vocab_size=10, eos_token_ids=[1]), [rollout])
    assert list(tmp_path.iterdir()) == []


def test_the_vocabulary_covers_the_models_padded_embedding_table(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"vocab_size": 151936}))
    assert model_vocab_size(str(tmp_path), 151665) == 151936
    (tmp_path / "config.json").write_text(json.dumps({"text_config": {"vocab_size": 262208}}))
    assert model_vocab_size(str(tmp_path), 262145) == 262208
    assert model_vocab_size(str(tmp_path / "missing"), 100) == 100


@pytest.mark.parametrize("name", ["run.jsonl.gz", "run.jsonl"])
def test_a_growing_trace_appends_each_flush_and_costs_what_it_adds(tmp_path, name, monkeypatch):
    """Each flush appends its rollouts (a gzip member for .gz) instead of writing the trace again:
    the bytes a flush writes do not grow with the trace. A flush whose epoch goes back rewrites the
    file sorted, so the trace keeps the format's order."""
    import ngramrl.core.trace as trace_module

    path = str(tmp_path / name)
    writer = trace_module.TraceWriter(path, TRACE_HEADER)
    rewrites = []
    real_write = trace_module.write_trace
    monkeypatch.setattr(trace_module, "write_trace", lambda *a: rewrites.append(a[0]) or real_write(*a))
    sizes = []
    for epoch in range(4):
        for sample in range(3):
            writer.add(Rollout(f"p{epoch % 2}", epoch, sample, [1, 2], [3, 4, 5, epoch]))
        writer.flush()
        sizes.append(os.path.getsize(path))
        assert [(r.epoch, r.sample) for r in read_trace(path).rollouts] == [
            (e, s) for e in range(epoch + 1) for s in range(3)]
    assert rewrites == [path]  # the first flush writes the file; the others append
    grown = [b - a for a, b in zip(sizes, sizes[1:], strict=False)]
    assert max(grown) - min(grown) <= 8  # each epoch adds about the same bytes
    writer.add(Rollout("p9", 1, 0, [1, 2], [7]))  # epoch 1 after epoch 3 was written
    writer.flush()
    assert rewrites == [path, path] and writer.count == 13
    assert [r.epoch for r in read_trace(path).rollouts] == [0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 3, 3, 3]


@pytest.mark.parametrize("name", ["run.jsonl.gz", "run.jsonl"])
def test_an_append_cut_short_is_cut_off_and_the_trace_goes_on(tmp_path, name):
    """A writer stopped in an append leaves a torn tail: the whole part reads, and a writer that
    continues the trace drops the tail and appends after the whole part."""
    from ngramrl.core.trace import TraceWriter, iter_trace, whole_length

    path = str(tmp_path / name)
    writer = TraceWriter(path, TRACE_HEADER)
    writer.add(Rollout("p", 0, 0, [1], [2, 3]))
    writer.flush()
    writer.add(Rollout("p", 1, 0, [1], [4, 5]))
    writer.flush()
    whole = os.path.getsize(path)
    with open(path, "ab") as handle:  # the next append, cut short
        line = json.dumps(Rollout("p", 2, 0, [1], [6]).to_json()).encode() + b"\n"
        handle.write((gzip.compress(line) if name.endswith(".gz") else line)[:-5])
    with pytest.raises(TraceError):
        read_trace(path)
    assert whole_length(path) == whole
    assert [r.epoch for r in iter_trace(path, whole) if isinstance(r, Rollout)] == [0, 1]
    going_on = TraceWriter(path, TRACE_HEADER, continue_at=whole, count=2, last_epoch=1)
    going_on.add(Rollout("p", 2, 0, [1], [6, 7]))
    going_on.flush()
    assert [r.output for r in read_trace(path).rollouts] == [[2, 3], [4, 5], [6, 7]]

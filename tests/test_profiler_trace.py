import pytest

from hf_memo.profiler.trace import AllocationEvent, AllocationTrace


def _trace():
    return AllocationTrace(
        [
            AllocationEvent("malloc", 1, 512, "layer 0 forward", "activation"),
            AllocationEvent("malloc", 2, 64, "layer 0 forward", "temporary", "host"),
            AllocationEvent("free", 2, 64, "layer 0 forward", "temporary", "host"),
            AllocationEvent("free", 1, 512, "layer 0 backward", "activation"),
        ],
        {"model": "tiny", "seq_len": 128},
    )


def test_jsonl_round_trip_keeps_every_event_and_the_meta(tmp_path):
    path = tmp_path / "trace.jsonl"
    _trace().save(path)
    loaded = AllocationTrace.load(path)
    assert loaded.events == _trace().events and loaded.meta == {"model": "tiny", "seq_len": 128}
    assert path.read_text().splitlines()[1] == (
        '{"op": "malloc", "id": 1, "bytes": 512, "phase": "layer 0 forward", "category": "activation", '
        '"location": "device"}'
    )


def test_memo_tuples_and_phase_selection():
    trace = _trace()
    assert trace.as_tuples() == [("malloc", 1, 512), ("free", 1, 512)]
    assert len(trace.as_tuples(location=None)) == 4
    assert [e.tensor_id for e in trace.select(["layer 0 backward"]).events] == [1]


@pytest.mark.parametrize(
    "line,message",
    [
        ('{"op": "alloc", "id": 1, "bytes": 5}', "op must be one of malloc, free"),
        ("not json", "not a trace event"),
        ('{"op": "malloc", "bytes": 5}', "not a trace event"),
    ],
)
def test_malformed_lines_name_the_line(tmp_path, line, message):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"format": "hf_memo-trace", "version": 1, "meta": {}}\n' + line + "\n")
    with pytest.raises(ValueError, match=f"bad.jsonl:2: {message}"):
        AllocationTrace.load(path)


def test_owned_buffer_names_round_trip_and_are_omitted_when_absent(tmp_path):
    path = tmp_path / "t.jsonl"
    AllocationTrace([AllocationEvent("malloc", 3, 1024, name="layer 2 rounding 0")]).save(path)
    assert '"name": "layer 2 rounding 0"' in path.read_text()
    assert AllocationTrace.load(path).events[0].name == "layer 2 rounding 0"
    assert "name" not in AllocationEvent("malloc", 1, 8).to_json()

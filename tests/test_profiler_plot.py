from hf_memo.profiler.plot import plot_timelines
from hf_memo.profiler.step import trace_training_step
from tests.test_profiler_step import build


def test_timeline_png_has_one_panel_per_trace(tmp_path):
    traces = {}
    for mode in ("vanilla", "minseq"):
        model, session = build("llama", mode)
        with session:
            traces[mode] = trace_training_step(model, 1, 512)
    path = tmp_path / "timeline.png"
    plot_timelines(traces, path, "tiny Llama", limit=4 << 20)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert path.stat().st_size > 10_000

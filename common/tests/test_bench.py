"""Tests of coursekit.bench's sweep helpers on the CPU: the notes of what a sweep skipped, a
refusal turned into a note, the probe that sizes each graph, the probed timing, the rounds of
the interleaved timing and the graph capture's order of calls (its CUDA calls replaced)."""
import sys
import warnings
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "common"))
from coursekit import bench  # noqa: E402


@pytest.mark.parametrize("est_ms, calls", [(0.0, 8), (0.1, 8), (0.5, 4), (0.7, 3), (2.0, 1), (50.0, 1)])
def test_calls_per_replay(est_ms, calls):
    assert bench.calls_per_replay(est_ms) == calls


def test_notes_record_each_reason_once():
    notes = bench.Notes()
    for op in ("attention_forward", "attention_backward"):
        notes.skip("default", f"flash_attention: {bench.NO_KERNELS} ({op} was called with tensors on cuda:0)", op)
    notes.skip("sdpa_cudnn", "No available kernel", "s=512")
    notes.skip("sdpa_cudnn", "No available kernel", "s=1024")
    assert [(n["variant"], n["first_at"]) for n in notes.skipped] == [
        ("default", "attention_forward"), ("sdpa_cudnn", "s=512")]


def test_attempt_turns_a_refusal_into_a_note():
    notes = bench.Notes()

    def refuse():
        raise RuntimeError("flash_attention: no CUDA kernels in this build yet (attention_forward ...)")
    assert bench.attempt(notes, "v1", "here", refuse) is None
    assert bench.attempt(notes, "v1", "here", lambda: 3) == 3
    assert len(notes.skipped) == 1 and bench.NO_KERNELS in notes.skipped[0]["reason"]


def test_a_refusal_names_the_warnings_it_gave_first():
    """SDPA warns why before it raises "No available kernel": the note carries both, once each."""
    notes = bench.Notes()

    def refuse():
        for _ in range(2):
            warnings.warn("Flash attention requires q, k, v to have the same last dimension")
        raise RuntimeError("No available kernel.  Aborting execution.\nsecond line")
    bench.attempt(notes, "sdpa_flash", "d=48", refuse)
    assert notes.skipped[0]["reason"] == ("No available kernel.  Aborting execution. [Flash attention requires "
                                          "q, k, v to have the same last dimension]")
    assert bench.first_line(ValueError()) == "ValueError"


def test_probe_and_time_on_the_cpu():
    calls = []
    notes = bench.Notes()
    t = bench.probe_and_time(notes, "v1", "here", "cpu", lambda: calls.append(1))
    assert t["reps"] == bench.MIN_REPS and len(calls) == 2 + bench.MIN_REPS  # the probe's two, then the reps
    assert bench.probe_and_time(notes, "slow", "there", "cpu", lambda: None, max_call_ms=-1.0) is None
    assert notes.skipped[0]["variant"] == "slow" and "not timed" in notes.skipped[0]["reason"]


def test_time_interleaved_on_the_cpu_takes_rounds():
    """Every round calls each variant once (not a's calls, then b's), in the orders round_orders
    draws, which differ from round to round and from which each variant follows every other."""
    log = []
    probed = [(name, (lambda n=name: log.append(n)), 0.0) for name in ("a", "b", "c")]
    timed = bench.time_interleaved(bench.Notes(), "here", "cpu", probed)
    assert len(timed) == 3 and all(t["reps"] == bench.MIN_REPS for t in timed)
    orders = bench.round_orders(3, bench.MIN_REPS)
    assert log == ["abc"[i] for order in orders for i in order]
    assert all(sorted(order) == [0, 1, 2] for order in orders) and len({tuple(o) for o in orders}) > 1
    follows = {(log[j - 1], log[j]) for j in range(1, len(log))}
    assert {(x, y) for x in "abc" for y in "abc" if x != y} <= follows
    assert orders == bench.round_orders(3, bench.MIN_REPS), "the same orders every run"


def test_probe_noted_skips_the_slow_and_the_refused():
    notes = bench.Notes()
    assert bench.probe_noted(notes, "ok", "here", "cpu", lambda: None) is not None
    assert bench.probe_noted(notes, "slow", "here", "cpu", lambda: None, max_call_ms=-1.0) is None

    def refuse():
        raise RuntimeError("refused")
    assert bench.probe_noted(notes, "refused", "here", "cpu", refuse) is None
    assert [n["variant"] for n in notes.skipped] == ["slow", "refused"]


def test_time_calls_interleaved_keeps_order_tags_and_notes():
    """The calls that probe are timed in rounds and come back in their order with their tags; a
    refused call and one slower than max_call_ms are noted (at where_of's place) and left out."""
    log = []

    def refuse():
        raise RuntimeError("refused")
    calls = [("a", lambda: log.append("a"), {"k": 1}), ("b", refuse, {"k": 2}), ("c", lambda: log.append("c"), {"k": 3})]
    notes = bench.Notes()
    got = bench.time_calls_interleaved(notes, "rounds", "cpu", calls, where_of=lambda tag: f"call {tag['k']}")
    assert [(v, tag) for v, tag, _ in got] == [("a", {"k": 1}), ("c", {"k": 3})]
    assert all(t["reps"] == bench.MIN_REPS for _, _, t in got)
    assert [(n["variant"], n["first_at"]) for n in notes.skipped] == [("b", "call 2")]
    assert log.count("a") == log.count("c") == 2 + bench.MIN_REPS  # the probe's two calls, then one a round
    notes = bench.Notes()
    assert bench.time_calls_interleaved(notes, "here", "cpu", calls[:1], max_call_ms=-1.0) == []
    assert notes.skipped[0]["variant"] == "a" and "not timed" in notes.skipped[0]["reason"]


def test_capture_graph_warms_up_then_captures_the_rotation(monkeypatch):
    """capture_graph (time_cuda_graph's and time_interleaved's capture), with the CUDA calls
    replaced: up to three warm-up calls on the side stream, then `calls` calls captured, i
    rotating over the sets."""
    import contextlib
    phase, log = ["none"], []

    class Stream:
        def wait_stream(self, other):
            pass

    @contextlib.contextmanager
    def in_phase(name):
        phase[0] = name
        yield
        phase[0] = "none"

    monkeypatch.setattr(bench, "capture_stream", Stream)
    monkeypatch.setattr(torch.cuda, "current_stream", Stream)
    monkeypatch.setattr(torch.cuda, "stream", lambda s: in_phase("warm-up"))
    monkeypatch.setattr(torch.cuda, "CUDAGraph", object)
    monkeypatch.setattr(torch.cuda, "graph", lambda g, stream: in_phase("capture"))
    bench.capture_graph(lambda i: log.append((phase[0], i)), sets=5, calls=8)
    assert log == [("warm-up", i) for i in range(3)] + [("capture", i % 5) for i in range(8)]
    log.clear()
    bench.capture_graph(lambda i: log.append((phase[0], i)), sets=1, calls=2)
    assert log == [("warm-up", 0), ("capture", 0), ("capture", 0)]

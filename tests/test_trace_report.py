"""bench/trace_report.py: what a GPU did, from the records bench/gpu/cupti_trace.c
writes, laid over the ranks' timelines (the device has no Nsight Systems)."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import trace_report  # noqa: E402


def test_busy_time_and_idle_gaps_count_overlapping_kernels_once():
    kernels = [(0, 10, 1, "a"), (5, 20, 2, "b"), (30, 40, 1, "c"), (45, 60, 1, "d")]
    intervals = [(s, e) for s, e, _, _ in kernels]
    assert trace_report.busy_ns(intervals, 0, 50) == 20 + 10 + 5
    assert trace_report.gaps(intervals, 0, 50) == [10, 5]
    assert trace_report.gaps(intervals, -5, 70) == [5, 10, 5, 10]


def test_a_trace_is_read_by_kind_and_windows_find_long_records(tmp_path):
    """Every kind of record is read, a line cut short at the end is skipped, and a
    window finds a kernel that began long before it (an all-sum waiting for its peer)."""
    path = tmp_path / "rank0-1.tsv"
    path.write_text(
        "K\t100\t5000\t7\t0\tncclDevKernel_AllReduce\n"
        "K\t200\t300\t7\t0\tqmm_kernel\n"
        "C\t400\t410\t7\t65536\t8\n"
        "S\t500\t900\t4294967295\t1\n"
        "A\t500\t900\t12\tR:cudaEventSynchronize\n"
        "K\t4000\t41"
    )
    t = trace_report.read_trace(path)
    assert [k[3] for k in t.kernels] == ["ncclDevKernel_AllReduce", "qmm_kernel"]
    assert t.copies[0][3] == "C8 65536 B" and t.syncs[0][3] == "sync type 1"
    assert t.calls[0][3] == "R:cudaEventSynchronize"
    assert [k[3] for k in trace_report.inside(t.kernels, 4000, 4500)] == ["ncclDevKernel_AllReduce"]
    assert trace_report.is_nccl("ncclDevKernel_AllReduce") and not trace_report.is_nccl("qmm")

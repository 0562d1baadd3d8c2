"""benchmarks.serve_peers' summary over repeats: the medians and their ratios to vLLM's, from measured records."""

from __future__ import annotations

from benchmarks.client import BenchResult, RequestRecord
from benchmarks.serve_peers import medians
from benchmarks.workload import BenchConfig


def _result(tok_s: float, ttft_s: float) -> BenchResult:
    """One request of 11 tokens over 1 s: its TTFT ttft_s, its TPOT (1 - ttft_s) / 10; duration 11 / tok_s."""
    record = RequestRecord(10, 11, ok=True, ttft_s=ttft_s, e2e_s=1.0, output_tokens=11)
    return BenchResult(BenchConfig(base_url="", model="m"), 11 / tok_s, [record])


def test_medians_over_repeats_and_their_ratio_to_vllm():
    repeats = [{"vllm serve, c=16": _result(1000, 0.2), "raypd disaggregated, c=16": _result(1300, 0.1)},
               {"vllm serve, c=16": _result(1500, 0.3), "raypd disaggregated, c=16": _result(1200, 0.15)},
               {"vllm serve, c=16": _result(1200, 0.1), "raypd disaggregated, c=16": _result(1800, 0.12)}]
    lines = medians(repeats).splitlines()
    assert lines[0].startswith("medians over 3 repeats")
    tok_s = next(line for line in lines if "raypd disaggregated, c=16" in line and "output tok/s" in line)
    assert tok_s.split()[5:7] == ["1300", "1.08x"]  # medians 1300 and 1200, not the ratio of any one repeat
    assert "[1300, 1200, 1800]" in tok_s
    ttft = next(line for line in lines if "raypd disaggregated, c=16" in line and "TTFT" in line)
    assert ttft.split()[6:8] == ["120.0", "0.60x"]  # 120 ms against vLLM's median 200 ms
    vllm = next(line for line in lines if "vllm serve, c=16" in line and "output tok/s" in line)
    assert "x" not in vllm.split("[")[0].split()[-1]  # the reference has no ratio to itself


def test_a_system_that_completed_nothing_gets_no_ratio_and_no_crash():
    failed = BenchResult(BenchConfig(base_url="", model="m"), 1.0, [RequestRecord(10, 11)])  # not ok
    lines = medians([{"vllm serve, c=1": failed, "raypd disaggregated, c=1": _result(300, 0.02)}]).splitlines()
    raypd = [line for line in lines if line.lstrip().startswith("raypd")]
    assert len(raypd) == 3 and all(line.split("[")[0].split()[-1] == "-" for line in raypd)
    assert "nan" in next(line for line in lines if "vllm serve" in line and "TTFT" in line)

"""raypd bench's speculation line, from /metrics as the ingress renders it."""

from __future__ import annotations

from benchmarks.server_stats import parse, speculation_lines
from cluster.edge.metrics import Metrics


def _rendered(decode: dict[str, float]) -> dict[tuple[str, str], float]:
    metrics = Metrics()
    metrics.set_kv("decode", decode)
    metrics.set_kv("prefill", {"kv_blocks_in_use": 3.0})
    return parse(metrics.render().decode())


def test_speculation_line_counts_what_changed_during_the_run():
    before = _rendered({"spec_draft_tokens": 100, "spec_accepted_tokens": 40, "spec_verify_steps": 30})
    after = _rendered({"spec_draft_tokens": 300, "spec_accepted_tokens": 140, "spec_verify_steps": 80})
    assert after[("prefill", "kv_blocks_in_use")] == 3.0
    assert speculation_lines(before, after) == [
        "speculation (decode): 200 draft tokens, 100 accepted (50%), 3.00 tokens per verify step"]
    assert speculation_lines(after, after) == [] and speculation_lines({}, {}) == []

"""What a raypd endpoint's /metrics says changed during a benchmark: speculative decoding's drafts and accepted tokens
per role. Another server's /metrics (or none) gives nothing to print."""

from __future__ import annotations

import re

import httpx

SPEC = ("spec_draft_tokens", "spec_accepted_tokens", "spec_verify_steps")
_LINE = re.compile(r'^raypd_kv\{role="(?P<role>[^"]+)",what="(?P<what>[^"]+)"\} (?P<value>\S+)$')


def scrape(base_url: str, api_key: str | None = None, timeout_s: float = 5.0) -> dict[tuple[str, str], float]:
    """(role, what) -> value of every raypd_kv series at base_url's /metrics ({} if there is none)."""
    root = base_url.rstrip("/").removesuffix("/v1")
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        return parse(httpx.get(f"{root}/metrics", headers=headers, timeout=timeout_s, trust_env=False).text)
    except httpx.HTTPError:
        return {}


def parse(text: str) -> dict[tuple[str, str], float]:
    """The raypd_kv series of a Prometheus text exposition."""
    found = (_LINE.match(line) for line in text.splitlines())
    return {(m["role"], m["what"]): float(m["value"]) for m in found if m}


def speculation_lines(before: dict[tuple[str, str], float], after: dict[tuple[str, str], float]) -> list[str]:
    """One line per role whose engines verified drafts between the two scrapes."""
    lines = []
    for role in sorted({role for role, what in after if what == SPEC[0]}):
        drafted, accepted, steps = (after.get((role, w), 0.0) - before.get((role, w), 0.0) for w in SPEC)
        if drafted > 0:
            lines.append(f"speculation ({role}): {drafted:.0f} draft tokens, {accepted:.0f} accepted "
                         f"({accepted / drafted:.0%}), {1 + accepted / max(steps, 1):.2f} tokens per verify step")
    return lines

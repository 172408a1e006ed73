"""Every request queued or running as a status page shows it: its phase, tokens so far,
timings and prompt-cache hit (the scheduler's `snapshot`)."""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import Any

from mlx_relay.coordinator.sequence import Request, Sequence


def rows(waiting: Iterable[Request], running: Iterable[Sequence]) -> list[dict[str, Any]]:
    """One row a request, the oldest first."""
    now = time.perf_counter()
    out: list[dict[str, Any]] = [
        {
            "request_id": r.request_id,
            "phase": "queued",
            "prompt_tokens": len(r.prompt_tokens),
            "age_s": now - r.created,
        }
        for r in waiting
    ]
    for seq in running:
        r, first, generated = seq.request, seq.first_token_at, len(seq.generated)
        row = {
            "request_id": r.request_id,
            "phase": "prefill" if first is None else "decode",
            "prompt_tokens": len(r.prompt_tokens),
            "prefilled_tokens": len(r.prompt_tokens) - len(seq.pending),
            "cached_tokens": seq.cached_tokens,
            "generated_tokens": generated,
            "age_s": now - r.created,
        }
        if seq.draft_tokens:
            row["draft_tokens"] = seq.draft_tokens
            row["accepted_draft_tokens"] = seq.accepted_draft_tokens
        if first is not None:
            row["time_to_first_token_s"] = first - r.created
            if generated > 1 and now > first:
                row["decode_tokens_per_s"] = (generated - 1) / (now - first)
        out.append(row)
    return sorted(out, key=lambda row: -row["age_s"])

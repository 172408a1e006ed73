"""Speculative decoding's one owner: the server's settings, the loaded model's drafter,
what a verify step costs here, and the rounds' counts.

The scheduler holds it: it decides which new sequences speculate (`start`), drafts a
round as it plans it (`draft`) and follows what each round kept (`verified`). The
rules of one sequence's rounds are speculation.py's; the drafters, drafting.py's.
"""

from __future__ import annotations

import dataclasses
import logging

from mlx_relay.coordinator.drafting import Drafter, make_drafter
from mlx_relay.coordinator.model_context import ModelContext
from mlx_relay.coordinator.plan import Verify
from mlx_relay.coordinator.sequence import Request
from mlx_relay.coordinator.speculation import (
    PROBE_WIDTHS,
    RoundCost,
    SpecConfig,
    SpecState,
    blocker,
    never_pays,
)
from mlx_relay.coordinator.stats import EngineStats
from mlx_relay.model import memory

log = logging.getLogger("mlx_relay.speculator")


class Speculator:
    def __init__(self, config: SpecConfig | None, stats: EngineStats) -> None:
        self.config = config  # None: the server does not speculate
        self.stats = stats
        self.blocked = ""  # why the loaded model cannot speculate ('' if it can)
        self.drafter = Drafter()  # the loaded model's proposals
        self.round_cost = RoundCost()  # what a verify step takes by its width, here

    def load(self, model: ModelContext, max_context: int) -> None:
        """A model was loaded: whether it can speculate, and its drafter (a draft model
        must share its tokenizer and fit beside rank 0's shard: ValueError if not)."""
        self.drafter = Drafter()
        self.round_cost = RoundCost()
        self.blocked = blocker(model.shard) if self.config else ""
        if self.blocked:
            log.warning("this model decodes without speculation: %s", self.blocked)
        elif self.config is not None:
            bound = memory.sequence_bound(model.context_length, max_context)
            self.drafter = make_drafter(self.config, model.tokenizer, bound)

    def widths_to_time(self, wider: bool = True) -> list[int]:
        """The step widths to time at load (`measured`): one position, a round of K
        proposals, and (`wider`) the wider steps that may cost less; none where drafting
        is off or fixed (--draft-fixed: proposals every round, as asked)."""
        config = self.config
        if config is None or self.blocked or not config.adaptive:
            return []
        return sorted({1, config.num_draft_tokens + 1, *(PROBE_WIDTHS if wider else ())})

    def measured(self, seconds: dict[int, float]) -> None:
        """Steps timed at load by width: where no round can pay here, drafting is off for
        this load (`blocked` says why: the status shows it); else the rounds' costs
        start from these figures instead of probing them on requests."""
        assert self.config is not None
        for width, took in seconds.items():
            self.round_cost.took(width, took)
        self.blocked = never_pays(seconds, self.config.num_draft_tokens)
        if self.blocked:
            log.warning("this load decodes without speculation: %s", self.blocked)

    def start(self, request: Request, running: int) -> SpecState | None:
        """A new sequence's speculation: on where the server has it and the model allows
        it, unless the request turns it off (num_draft_tokens 0), follows a grammar (its
        matcher moves one token at a time), carries images, or `running` sequences are
        already more than `max_streams` (alone on its caches it would cost the batched
        streams more)."""
        config, wanted = self.config, request.params.num_draft_tokens
        if config is None or self.blocked or wanted == 0:
            return None
        if request.constraint is not None or request.pixel_values is not None:
            return None
        if running >= config.max_streams:
            return None
        limit = min(config.num_draft_tokens, wanted or config.num_draft_tokens)
        return SpecState(k=limit, limit=limit, adaptive=config.adaptive)

    def draft(self, verify: Verify) -> Verify:
        """The round with the drafter's proposals after its input, and its width: one
        position more, or a wider step where that costs less here (adaptive rounds:
        RoundCost.padded; the positions past the proposals are cut back as refused)."""
        seq = verify.seq
        assert seq.spec is not None
        proposed = self.drafter.propose(
            seq.spec, seq.sampler, verify.history, verify.input, verify.k
        )
        k = proposed.shape[0]
        if not seq.spec.adaptive or not k:  # (none: exactly at its position after the
            width = 1 + k  # round, to time it or join a group)
        else:
            width = self.round_cost.padded(1 + k)
        return dataclasses.replace(verify, k=k, proposed=proposed, width=width)

    def verified(self, verify: Verify, tokens: list[int]) -> tuple[list[int], int]:
        """A round read back: its proposals as values, and how many were kept (those up
        to the first that differs from what was sampled); counted."""
        proposed = verify.proposed.tolist() if verify.proposed is not None else []
        kept = 0
        while kept < len(proposed) and tokens[kept] == proposed[kept]:
            kept += 1
        self.stats.round(verify.k, kept)
        return proposed, kept

    def settle(self, verify: Verify, proposed: int, kept: int) -> None:
        """A round of `proposed` tokens kept `kept`: its caches hold the refused ones too,
        so the sequence's position goes back to what they truly hold (its next step cuts
        them out), and its next round asks for as many as pay (SpecState.record)."""
        seq = verify.seq
        assert seq.spec is not None
        seq.position -= verify.width - 1 - kept
        seq.spec.record(proposed, kept, self.round_cost)
        seq.draft_tokens += proposed
        seq.accepted_draft_tokens += kept

    def next_round(self, verify: Verify, proposed: list[int], kept: int, running: int) -> bool:
        """After a round whose tokens all went out: the drafter follows what it kept, or
        the sequence stops speculating (True: it joins a decode group). It leaves once
        more than `max_streams` sequences run, after a round of exactly its position."""
        seq, spec = verify.seq, verify.seq.spec
        assert spec is not None and self.config is not None
        if running > self.config.max_streams:
            spec.leaving = True  # (streams came: it decodes in a group from now on)
        if spec.leaving and verify.width == 1:  # its caches hold exactly its position
            seq.spec = None
            self.drafter.drop(spec)
            return True
        self.drafter.rewind(spec, proposed, kept, verify.history[-1])
        return False

    def drop(self, spec: SpecState) -> None:
        """A sequence ended or stopped speculating: the drafter lets go of it."""
        self.drafter.drop(spec)

    def took(self, width: int, seconds: float) -> None:
        self.round_cost.took(width, seconds)

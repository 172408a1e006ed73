"""Prompt caches that last (--prompt-cache-dir): real ranks keep their layers' blocks on
disk; a prefix pushed out of the kept caches, or from before a restart, is loaded instead
of prefilled, and the tokens stay single-process mlx-lm's."""

from __future__ import annotations

import time
import zlib
from pathlib import Path

import pytest
from oracle import chat_tokens, mlx_lm_tokens

from mlx_relay.model.prefix_store import BLOCK_TOKENS
from mlx_relay.protocol import relay_pb2 as pb

pytestmark = pytest.mark.cluster

SYSTEM = "You are a careful assistant for a harbour office. " * 40
QUESTIONS = ["Which boats leave at dawn?", "Who keeps the lighthouse?"]
OTHER = [{"role": "user", "content": "Count from one to twenty in words, please."}]


def _messages(question: str) -> list[dict]:
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]


def _ask(running, messages: list[dict], max_tokens: int = 12) -> pb.GenerateResponse:
    request = pb.GenerateRequest(
        messages=[pb.ChatMessage(role=m["role"], content=m["content"]) for m in messages],
        params=pb.SamplingParams(max_tokens=max_tokens),
    )
    return running.client.generate(request)


def _eventually(check, timeout: float = 30.0) -> bool:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def _files(store: Path) -> list[Path]:
    return sorted(store.rglob("*.safetensors"))


def test_a_prefix_pushed_out_or_from_before_a_restart_is_loaded(
    tiny_model, tmp_path, cluster_factory
):
    model = tiny_model("llama", 4)
    store = tmp_path / "prompt-store"
    args = ("--prompt-cache-dir", str(store), "--max-active", "1")
    prompts = [chat_tokens(model, _messages(q)) for q in QUESTIONS]
    expected = [mlx_lm_tokens(model, p, 12) for p in prompts]
    assert len(prompts[0]) > 3 * BLOCK_TOKENS, len(prompts[0])
    shared = min(len(prompts[0]), len(prompts[1]))
    whole = next(i for i in range(shared) if prompts[0][i] != prompts[1][i]) // BLOCK_TOKENS

    running = cluster_factory(model, 2, *args)
    first = _ask(running, _messages(QUESTIONS[0]))
    assert list(first.token_ids) == expected[0] and first.usage.cached_tokens == 0
    # (the blocks are written right after the answer's last chunk is handed over)
    blocks = len(prompts[0]) // BLOCK_TOKENS
    assert _eventually(lambda: len(_files(store)) >= 2 * blocks), _files(store)
    _ask(running, OTHER)  # (one slot: the parked conversation is pushed out of RAM)
    second = _ask(running, _messages(QUESTIONS[1]))
    assert list(second.token_ids) == expected[1]
    assert second.usage.cached_tokens == whole * BLOCK_TOKENS > 0
    status = running.client.status()
    shown = status.prompt_store
    assert (shown.dir, shown.off_reason, shown.restores) == (str(store), "", 1)
    assert shown.restored_tokens == whole * BLOCK_TOKENS and shown.blocks >= blocks
    # The tiers: the disk's served the second prompt's prefix; the three prompts' tokens
    # are what hit rates are of.
    tiers = {t.tier: t for t in status.prompt_cache_tiers}
    disk = tiers["disk"]
    assert (disk.entries, disk.bytes, disk.hit_tokens) == (
        shown.blocks,
        shown.bytes,
        shown.restored_tokens,
    )
    asked = len(prompts[0]) + len(prompts[1]) + len(chat_tokens(model, OTHER))
    assert status.prompt_tokens == asked and tiers["ram"].hit_tokens == 0
    assert disk.hit_rate == pytest.approx(disk.hit_tokens / asked)
    running.stop()

    # Started again with the same model, split and store: the blocks are found.
    running = cluster_factory(model, 2, *args)
    again = _ask(running, _messages(QUESTIONS[0]))
    assert list(again.token_ids) == expected[0]
    assert again.usage.cached_tokens == (len(prompts[0]) - 1) // BLOCK_TOKENS * BLOCK_TOKENS
    running.stop()

    # A flipped byte in the first block of one rank's store, then of the other's (rank
    # 0 finds its own before sending the restore; a worker fails the restore step):
    # found by its checksum and removed, the prompt prefilled, the answer still exact,
    # and the blocks written again.
    for rank_store in sorted(p for p in store.iterdir() if p.is_dir()):
        first_block = sorted(_files(rank_store), key=lambda f: f.stat().st_mtime)[0]
        data = bytearray(first_block.read_bytes())
        data[len(data) // 2] ^= 0xFF
        first_block.write_bytes(bytes(data))
        running = cluster_factory(model, 2, *args)
        mended = _ask(running, _messages(QUESTIONS[0]))
        assert list(mended.token_ids) == expected[0]
        assert mended.usage.cached_tokens == 0
        running.stop()
        logs = "".join(f.read_text() for f in running.log_dir.glob("*.log"))
        assert f"{first_block.name} is damaged" in logs
        # (written again whole when the prompt's answer parked it)
        assert zlib.crc32(first_block.read_bytes()) == int(first_block.name.split(".")[1], 16)
    assert len({f.name.split(".")[0] for f in _files(store)}) > 3

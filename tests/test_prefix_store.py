"""A rank's prompt blocks on disk (model/prefix_store.py) and rank 0's index of them
(coordinator/prefix_index.py), in one process: what is written is what is read back,
nothing damaged or foreign is ever loaded, the budget holds, a failed write leaves the
cache RAM-only, and keys follow the tokens and the salt."""

from __future__ import annotations

import logging
import os

import mlx.core as mx
import pytest
from mlx_lm.models.cache import KVCache

from mlx_relay.coordinator.prefix_index import PrefixIndex
from mlx_relay.model.prefix_store import BLOCK_TOKENS, BlockStore, StoreError, identity

LAYERS = 3


def _caches(tokens: int, seed: int = 0) -> list[KVCache]:
    mx.random.seed(seed)
    out = []
    for _ in range(LAYERS):
        c = KVCache()
        c.update_and_fetch(mx.random.normal((1, 2, tokens, 8)), mx.random.normal((1, 2, tokens, 8)))
        out.append(c)
    return out


def _spec(**over) -> dict:
    return {"fingerprint": "fp", "ranges": [[0, 2], [2, 4]], "tensor": 1, "kv": None, **over}


def test_blocks_read_back_as_written(tmp_path):
    caches = _caches(3 * BLOCK_TOKENS + 5)
    store = BlockStore(tmp_path, "id", 10**9)
    assert store.save(caches, [(0, "a"), (1, "b"), (2, "c")]) > 0
    assert store.keys() == {"a", "b", "c"}
    got = store.load(["a", "b"])
    assert [c.offset for c in got] == [2 * BLOCK_TOKENS] * LAYERS
    for mine, theirs in zip(got, caches, strict=True):
        assert mx.array_equal(mine.keys, theirs.keys[..., : 2 * BLOCK_TOKENS, :]).item()
        assert mx.array_equal(mine.values, theirs.values[..., : 2 * BLOCK_TOKENS, :]).item()
    # A block past what the caches hold is not written; one already there is not again.
    assert store.save(caches, [(3, "d")]) == 0 and "d" not in store.keys()
    assert store.save(caches, [(0, "a")]) == 0
    # Found again by a new store on the same directory (a restart).
    assert BlockStore(tmp_path, "id", 10**9).keys() == {"a", "b", "c"}
    assert all(f.stat().st_mode & 0o077 == 0 for f in (tmp_path / "id").iterdir())


@pytest.mark.parametrize("damage", ["flipped", "truncated", "foreign", "another-store"])
def test_a_damaged_or_foreign_block_is_never_loaded(damage, tmp_path, caplog):
    store = BlockStore(tmp_path, "id", 10**9)
    store.save(_caches(BLOCK_TOKENS), [(0, "a")])
    (path,) = (tmp_path / "id").glob("a.*.safetensors")
    data = bytearray(path.read_bytes())
    if damage == "flipped":
        data[-3] ^= 0x10
        path.write_bytes(bytes(data))
    elif damage == "truncated":
        path.write_bytes(bytes(data[: len(data) // 2]))
    elif damage == "foreign":  # (another key's file under this key's name)
        other = BlockStore(tmp_path, "id", 10**9)
        other.save(_caches(BLOCK_TOKENS, seed=1), [(0, "b")])
        (b,) = (tmp_path / "id").glob("b.*.safetensors")
        b.rename(path.with_name(f"a.{b.name.split('.')[1]}.safetensors"))
        path.unlink()
    else:  # (a block of another model or split, copied into this store)
        elsewhere = BlockStore(tmp_path, "other-id", 10**9)
        elsewhere.save(_caches(BLOCK_TOKENS), [(0, "a")])
        (theirs,) = (tmp_path / "other-id").glob("a.*.safetensors")
        path.unlink()
        theirs.rename(tmp_path / "id" / theirs.name)
    store = BlockStore(tmp_path, "id", 10**9)
    with caplog.at_level(logging.WARNING), pytest.raises(StoreError, match="damaged"):
        store.load(["a"])
    assert "is damaged" in caplog.text
    assert store.keys() == set() and not list((tmp_path / "id").glob("a.*"))


def test_the_budget_holds_least_recently_used_out_first(tmp_path):
    caches = _caches(4 * BLOCK_TOKENS)
    store = BlockStore(tmp_path, "id", 10**9)
    store.save(caches, [(0, "a")])
    one = store.bytes
    store = BlockStore(tmp_path, "id", int(2.5 * one))
    store.save(caches, [(1, "b")])
    os.utime(next((tmp_path / "id").glob("a.*")), (1, 1))  # (a is the oldest)
    os.utime(next((tmp_path / "id").glob("b.*")), (2, 2))
    store.load(["a"])  # (a restore uses a: now b is the least recently used)
    store.save(caches, [(2, "c")])
    assert store.keys() == {"a", "c"} and store.bytes <= 2.5 * one


def test_a_store_that_cannot_be_made_stays_in_ram_with_one_warning(tmp_path, caplog):
    """A directory that cannot be made (here a file stands where it would go; a read-only
    disk answers the same way)."""
    (tmp_path / "taken").write_text("not a directory")
    with caplog.at_level(logging.WARNING):
        store = BlockStore(tmp_path / "taken", "id", 10**9)
        assert store.save(_caches(2 * BLOCK_TOKENS), [(0, "a"), (1, "b")]) == 0
    assert not store.writable and caplog.text.count("RAM only") == 1
    assert store.keys() == set()


def test_a_full_disk_leaves_the_cache_ram_only(tmp_path, caplog, monkeypatch):
    """A write that fails with ENOSPC (what a full disk answers os.write)."""
    store = BlockStore(tmp_path, "id", 10**9)
    real = os.write

    def full(fd: int, data) -> int:
        if str(os.readlink(f"/proc/self/fd/{fd}")).startswith(str(tmp_path)):
            raise OSError(28, "No space left on device")
        return real(fd, data)

    monkeypatch.setattr(os, "write", full)
    with caplog.at_level(logging.WARNING):
        assert store.save(_caches(2 * BLOCK_TOKENS), [(0, "a"), (1, "b")]) == 0
    assert not store.writable and "No space left" in caplog.text
    assert store.keys() == set()


def test_identity_changes_with_everything_blocks_depend_on():
    base = identity(_spec(), 1)
    assert identity(_spec(), 1) == base
    for other in (
        identity(_spec(), 0),
        identity(_spec(fingerprint="other"), 1),
        identity(_spec(ranges=[[0, 1], [1, 4]]), 1),
        identity(_spec(kv={"bits": 4, "group_size": 64, "start": 0}), 1),
        identity(_spec(tensor=2), 1),
    ):
        assert other != base


def test_keys_name_whole_prefixes_and_salts_keep_tenants_apart():
    index = PrefixIndex("seed")
    a = list(range(3 * BLOCK_TOKENS + 7))
    b = a[: 2 * BLOCK_TOKENS] + [9] * BLOCK_TOKENS
    ka, kb = index.keys(a), index.keys(b)
    assert len(ka) == 3 and ka[:2] == kb[:2] and ka[2] != kb[2]
    assert index.keys(a, "tenant-1")[0] != ka[0] != PrefixIndex("other").keys(a)[0]
    # What is missing is counted stored; the longest stored prefix leaves a token to run.
    assert [i for i, _ in index.missing(a[: 2 * BLOCK_TOKENS])] == [0, 1]
    assert index.longest(a) == ka[:2]
    assert index.longest(a[: 2 * BLOCK_TOKENS]) == ka[:1]  # (its last token runs)
    assert index.longest(a, "tenant-1") == []
    index.forget(ka[1:2])
    assert index.longest(a) == ka[:1]


def test_blocks_follow_the_tokens_not_the_slot(tmp_path):
    """Two sequences sharing a system prompt share its blocks' files."""
    index = PrefixIndex("seed")
    store = BlockStore(tmp_path, "id", 10**9)
    shared = list(range(2 * BLOCK_TOKENS))
    first, second = shared + [1] * BLOCK_TOKENS, shared + [2] * BLOCK_TOKENS
    store.save(_caches(len(first)), index.missing(first))
    written = index.missing(second)
    assert [i for i, _ in written] == [2]
    store.save(_caches(len(second)), written)
    assert len(store.keys()) == 4

"""An image prompt's tokens as the prompt cache compares them (coordinator/image_keys.py)."""

from __future__ import annotations

from mlx_relay.coordinator.image_keys import keyed

IMAGE = 9  # the placeholder id


def test_placeholders_are_keyed_by_the_images_and_text_stays():
    prompt = [1, 2, IMAGE, IMAGE, IMAGE, 3, IMAGE, 4]
    a = keyed(prompt, IMAGE, [b"cat", b"dog"])
    assert [t for t, p in zip(a, prompt, strict=True) if p != IMAGE] == [1, 2, 3, 4]
    keys = [t for t, p in zip(a, prompt, strict=True) if p == IMAGE]
    assert all(-(2**31) <= k < 0 for k in keys) and len(set(keys)) == 4  # (int32, apart)
    assert keyed(prompt, IMAGE, [b"cat", b"dog"]) == a  # the same images: the same keys
    assert keyed(prompt, IMAGE, [b"cat", b"cow"])[2] != a[2]  # any other: other keys
    assert keyed(prompt, IMAGE, [b"dog", b"cat"])[2] != a[2]  # (order counts)
    assert keyed(prompt, IMAGE, [b"catdog"])[2] != a[2]  # (and where one file ends)
    assert keyed([1, 2], IMAGE, [b"cat"]) == [1, 2]

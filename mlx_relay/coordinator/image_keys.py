"""An image prompt's tokens as the prompt cache compares them.

A vision prompt holds one placeholder token per image feature: the same ids whatever the
image, and the same ids a text prompt gets by spelling the placeholder out. So the
prompt cache (the parked slots, slots.py, and the stored blocks, prefix_index.py) does not
compare an image prompt's own ids: each placeholder position is replaced by a negative
key made from a digest of all the prompt's image files and the position's index among the
placeholders. Two prompts then share a cached prefix past an image only if they carry
the same images in the same order; text before the first image is shared as before, with
text prompts too; no token id a tokenizer gives is negative, so spelled-out placeholders
never match an image. (All the images in one digest: a prompt whose second image differs
shares nothing from its first image on, which errs on the side of computing again.)
"""

from __future__ import annotations

import hashlib

KEY_SPACE = 2**31 - 1  # keys are -1 .. -(2**31 - 1): negative int32, as blocks are hashed


def keyed(token_ids: list[int], image_token: int, images: list[bytes]) -> list[int]:
    """`token_ids` with every `image_token` position keyed by `images`' contents."""
    digest = hashlib.blake2b(digest_size=8)
    for image in images:
        digest.update(len(image).to_bytes(8, "little"))
        digest.update(image)
    base = int.from_bytes(digest.digest(), "little")
    out, placeholder = list(token_ids), 0
    for i, token in enumerate(token_ids):
        if token == image_token:
            out[i] = -1 - (base + placeholder) % KEY_SPACE
            placeholder += 1
    return out

"""The block pool's prefix cache evicts a chain from its tail: what stays cached of a
prompt is always its head, which a later request with that prompt can reach."""

import torch

from pdchat.core.generation.paged import BlockPool, Sequence, root_hash

BLOCK_TOKENS = 2


def pool(blocks: int) -> BlockPool:
    return BlockPool(
        layers=1, kv_heads=1, head_dim=2, block_tokens=BLOCK_TOKENS, blocks=blocks, dtype=torch.float32, device="cpu"
    )


def cached_prompt(kv: BlockPool, root: int, prompt: list[int]) -> None:
    """Prefill `prompt` in a sequence (its cached head reused) and release it: its full
    blocks stay cached."""
    sequence = Sequence(kv, root)
    held = sequence.reuse_prefix(prompt)
    sequence.extend(prompt[held:])
    sequence.written()
    sequence.release()


def test_a_partly_evicted_chain_still_serves_its_head_and_leaves_no_unreachable_block():
    kv = pool(blocks=1 + 4)  # room for one 4-block prompt
    root = root_hash("model", None)
    prompt = list(range(8))  # 4 full blocks
    cached_prompt(kv, root, prompt)
    assert kv.usage().cached_blocks == 4
    other = Sequence(kv, root_hash("model", "another tenant"))
    other.extend([100, 101, 102, 103])  # takes 2 blocks: 2 cached ones are evicted
    assert kv.evictions == 2 and kv.usage().cached_blocks == 2
    again = Sequence(kv, root)
    hit = again.reuse_prefix(prompt + [9])
    assert hit == 2 * BLOCK_TOKENS  # the surviving head: blocks 0 and 1
    assert kv.usage().cached_blocks == 0  # every block left cached was reachable, and is now in use


def test_a_head_shared_by_two_chains_is_evicted_after_both_tails():
    kv = pool(blocks=1 + 6)
    root = root_hash("model", None)
    cached_prompt(kv, root, [1, 2, 3, 4, 5, 6])  # blocks A B C
    cached_prompt(kv, root, [1, 2, 3, 4, 7, 8])  # A B (cached) D
    assert kv.usage().cached_blocks == 4
    filler = Sequence(kv, root_hash("model", "x"))
    filler.extend(list(range(100, 106)))  # 3 blocks: 2 free, then one eviction (a tail)
    filler.extend(list(range(106, 108)))  # one more eviction (the other tail)
    assert kv.evictions == 2
    assert Sequence(kv, root).reuse_prefix([1, 2, 3, 4, 5]) == 4  # A and B, the shared head, survive

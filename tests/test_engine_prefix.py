"""reusable_prefix: which leading prompt positions a slot's kept prefill covers (pure)."""

from edgespec.slots import reusable_prefix


def test_whole_chunks_of_the_common_prefix_only():
    prev = list(range(1000))
    assert reusable_prefix(prev, prev + [7], 256) == 768  # 1000 shared -> 3 whole chunks
    assert reusable_prefix(prev, prev[:600] + [-1] * 50, 256) == 512  # differs at 600
    assert reusable_prefix(prev, prev[:255] + [-1], 256) == 0  # less than a chunk in common
    assert reusable_prefix((), prev, 256) == 0  # nothing kept


def test_the_prompts_last_token_is_never_kept():
    prev = list(range(512))
    # the prompt's last token is the first root (decoded in the first step, never prefilled)
    assert reusable_prefix(prev, prev, 256) == 256
    assert reusable_prefix(prev, prev + [1], 256) == 512


def test_a_batch_invariant_engine_keeps_any_length():
    """chunk 1 (Engine.reuse_chunk on a CPU with the patched ggml): the whole common prefix."""
    prev = list(range(1000))
    assert reusable_prefix(prev, prev[:600] + [-1] * 50, 1) == 600
    assert reusable_prefix(prev, prev, 1) == 999  # never the prompt's last token
    assert reusable_prefix(prev, [5], 1) == 0

"""The packed row of a micro-batch, by hand: each group's prompt once, outputs without their
last token, positions as in each sample's own sequence; and the SDPA blocks over it."""

import torch

from train_batches import as_trained, TrainSample

from flexmarl.runtime import protocol as p
from flexmarl.workers.trainer.packed_attention import sdpa_blocks
from flexmarl.workers.trainer.packing import PackedBatch, Segment


def samples():
    return [TrainSample("a/0", [5, 6], [7, 8, 9], 1.0, [], [0]),
            TrainSample("a/1", [5, 6], [1, 2], 1.0, [], [0]),
            TrainSample("b/0", [4], [3], 1.0, [], [0])]


def test_a_groups_prompt_is_laid_once_and_each_output_follows_it_without_its_last_token():
    batch = PackedBatch.of(as_trained(samples()))
    #                  prompt a | a/0 in | a/1 in | prompt b   (b/0's one token is only a target)
    assert batch.input_ids.tolist() == [5, 6, 7, 8, 1, 4]
    assert batch.position_ids.tolist() == [0, 1, 2, 3, 2, 0]
    assert batch.segments == (Segment(0, 2), Segment(2, 2, 0, 2), Segment(4, 1, 0, 2), Segment(5, 1))
    # Output token j is predicted by the prompt's last row (j = 0), then by output row j - 1.
    assert batch.predictor.tolist() == [[1, 2, 3], [1, 4, 0], [5, 0, 0]]


def test_groups_are_packed_as_they_come_their_prompts_never_compared():
    """Two groups with the same prompt (two calls of one prompt) are two groups: each its
    prompt, as the controller sent them."""
    twice = [TrainSample("a/0", [5, 6], [7, 8], 1.0, [], [0]), TrainSample("c/0", [5, 6], [1, 2], 1.0, [], [0])]
    batch = PackedBatch.of(as_trained(twice))
    assert batch.input_ids.tolist() == [5, 6, 7, 5, 6, 1]
    assert [s.group for s in as_trained(twice)] == [0, 1]


def test_short_segments_share_one_sdpa_call_whose_mask_keeps_each_output_to_its_prompt_and_itself():
    (block,) = sdpa_blocks(PackedBatch.of(as_trained(samples())).segments, "cpu")
    assert (block.start, block.stop) == (0, 6) and block.keys.tolist() == list(range(6))
    allowed = {(q, k) for q, k in block.mask.nonzero().tolist()}
    assert allowed == {(0, 0), (1, 0), (1, 1),  # prompt a, causal
                       (2, 0), (2, 1), (2, 2), (3, 0), (3, 1), (3, 2), (3, 3),  # a/0: prompt a and itself
                       (4, 0), (4, 1), (4, 4),  # a/1: prompt a and itself, not a/0
                       (5, 5)}  # prompt b


def test_a_segment_longer_than_a_block_is_a_call_of_its_own_with_its_prompt_as_keys():
    long = [TrainSample("a/0", [5, 6, 7], list(range(1, 12)), 1.0, [], [0])]
    first, second = sdpa_blocks(PackedBatch.of(as_trained(long)).segments, "cpu", block_tokens=8)
    assert first.keys is None and first.mask is None and (first.start, first.stop) == (0, 3)  # the prompt: causal
    assert second.keys.tolist() == list(range(13)) and second.mask.shape == (10, 13)
    assert torch.equal(second.mask, torch.ones(10, 13, dtype=torch.bool).tril(3))  # aligned to the end

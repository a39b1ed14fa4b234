"""The batch contract: padding layout, trimming, splitting."""

import pytest
import torch

from hybrid_rl.batch import Sample, collate

pytestmark = pytest.mark.unit


def s(p, r, mask=None, group=0):
    return Sample(p, r, [-0.5] * len(r), mask or [1] * len(r), "stop", group)


def test_collate_layout():
    b = collate([s([1, 2, 3], [4, 5]), s([6], [7, 8, 9], [1, 0, 1], group=1)], pad_id=0)
    assert b.prompt_len == 3
    assert b.input_ids.tolist() == [[1, 2, 3, 4, 5, 0], [0, 0, 6, 7, 8, 9]]
    assert b.attention_mask.tolist() == [[1, 1, 1, 1, 1, 0], [0, 0, 1, 1, 1, 1]]
    assert b.position_ids.tolist() == [[0, 1, 2, 3, 4, 4], [0, 0, 0, 1, 2, 3]]
    assert b.response_mask.tolist() == [[1, 1, 0], [1, 0, 1]]
    assert b.response_ids.tolist() == [[4, 5, 0], [7, 8, 9]]
    assert b.group_ids.tolist() == [0, 1]
    assert b.rollout_logprobs[0].tolist() == [-0.5, -0.5, 0.0]


def test_trim_and_split():
    b = collate([s([1, 2, 3], [4]), s([5], [6, 7, 8])], pad_id=0)
    first = b.select([0]).trimmed()
    assert first.prompt_len == 3 and first.input_ids.tolist() == [[1, 2, 3, 4]]
    second = b.select([1]).trimmed()
    assert second.prompt_len == 1 and second.input_ids.tolist() == [[5, 6, 7, 8]]
    assert second.response_mask.shape == (1, 3)
    parts = b.split(1)
    assert [p.size for p in parts] == [1, 1]


def test_collate_rejects_misaligned_masks():
    bad = Sample([1], [2, 3], [0.0], [1, 1], "stop", 0)
    with pytest.raises(ValueError, match="sample 0"):
        collate([bad], pad_id=0)


def test_to_and_fields():
    b = collate([s([1], [2])], pad_id=0)
    b.advantages = torch.ones(1, 1)
    assert "advantages" in b.tensor_fields()
    assert b.to("cpu").advantages.tolist() == [[1.0]]

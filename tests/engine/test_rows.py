"""Row bookkeeping: where a row's tokens are cut, and why."""

import pytest

from redrafter_mlx.engine.rows import RowTracker

EOS = 2


@pytest.mark.parametrize(
    "step, max_tokens, kept, finish",
    [
        ([5, 6, 7], 10, [5, 6, 7], None),
        ([5, EOS, 7], 10, [5], "stop"),
        ([5, 6, 7], 2, [5, 6], "length"),
        ([5, 6, EOS], 3, [5, 6], "stop"),  # the EOS is within the room
        ([5, 6, 7, EOS], 3, [5, 6, 7], "length"),  # plain decoding would stop at 3 tokens, before the EOS
        ([5, 6, EOS, 8], 2, [5, 6], "length"),
    ],
)
def test_a_step_is_cut_at_eos_within_the_room_else_at_max_tokens(step, max_tokens, kept, finish):
    tracker = RowTracker([[1]], max_tokens, [EOS])
    (out,) = tracker.emit([step])
    assert (out.tokens, out.finish_reason) == (kept, finish)
    assert tracker.context[0] == [1] + kept

"""Role-relative granularities resolved against a weight's layout: input groups run along the flattened
contraction, whatever the layout of the weight."""

import warnings

import pytest

from eqjax.core.qarray import per_input_group
from eqjax.core.roles import GroupLayoutWarning, Layout, input_group_axes, resolve_granularity


@pytest.mark.parametrize("shape, contracting, group, axes", [
    ((576, 576), (0,), 128, (0,)),            # [K, N]: the plain layout
    ((9, 64, 576), (0, 1), 128, (0, 1)),      # [N, H, D] attention output: 576 = 4.5 groups, flattened
    ((8, 64, 512), (0, 1), 128, (0, 1)),      # 512 = 4 groups spanning two heads each
    ((4, 128, 512), (0, 1), 128, (1,)),       # the group divides the head: one axis says the same
    ((4, 128, 512), (0, 1), 64, (1,)),
    ((2, 3, 8, 16), (1, 2), 12, (1, 2)),      # free axes before and after
    ((2, 12, 8), (0, 1), 5, (0, 1)),          # divides nothing: all of K, a short last group
])
def test_groups_follow_the_flattened_contraction(shape, contracting, group, axes):
    assert input_group_axes(contracting, shape, group) == axes
    gran = resolve_granularity(per_input_group(group), Layout(contracting, ()), shape, "w")
    assert gran.axes == axes and gran.group_size == group


def test_groups_on_non_adjacent_axes_warn_naming_the_weight():
    with pytest.warns(GroupLayoutWarning, match=r"blocks/0/w: groups of 128 .* axes \(0, 2\)"):
        assert input_group_axes((0, 2), (8, 5, 64), 128, "blocks/0/w") == (2,)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert input_group_axes((0, 2), (8, 5, 128), 128, "w") == (2,)  # divides the last axis: exact

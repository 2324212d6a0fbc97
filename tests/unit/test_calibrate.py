"""FastKV's TSP-layer calibration on a tiny model."""

import pytest

from speedkv.analysis.calibrate import calibrate_tsp
from speedkv.errors import UserError

from conftest import random_prompt


def test_calibration_measures_every_candidate_and_picks_the_best(tiny, tiny_engine):
    prompts = [random_prompt(60, seed=s) for s in range(2)]
    result = calibrate_tsp(tiny_engine, prompts, tsp_rate=0.3, max_layer=4, progress=False)
    assert sorted(result.distances) == [0, 1, 2, 3, 4]
    assert all(d >= 0 for d in result.distances.values())
    assert result.distances[result.layer] == min(result.distances.values())
    assert result.spec() == f"fastkv:tsp_layer={result.layer},tsp_rate=0.3"
    # with tolerance, the earliest layer within the margin is chosen
    loose = calibrate_tsp(
        tiny_engine, prompts, tsp_rate=0.3, max_layer=4, tolerance=1e9, progress=False
    )
    assert loose.layer == 0


def test_calibration_rejects_bad_ranges(tiny_engine):
    with pytest.raises(UserError, match="TSP layers"):
        calibrate_tsp(tiny_engine, [random_prompt(20)], max_layer=9, progress=False)
    with pytest.raises(UserError, match="at least one prompt"):
        calibrate_tsp(tiny_engine, [], progress=False)

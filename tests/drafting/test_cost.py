"""The measured cost curve and its cache on disk."""

import json

import pytest

from conftest import tiny_redrafter
from redrafter_mlx.drafting.cost import LONG_SIZES, SIZES, CostCurve, cache_path
from redrafter_mlx.engine.calibrate import cost_curve as measured_curve
from redrafter_mlx.engine.decoder import fixed_costs


def cost_curve(*args, **kwargs):
    return measured_curve(*args, step_costs=fixed_costs, **kwargs)


def test_the_curve_is_measured_once_cached_and_rebuilt_when_corrupt(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("REDRAFTER_MLX_CACHE", str(tmp_path))
    redrafter = tiny_redrafter()
    redrafter.identity, redrafter.drafter_identity = "tiny", "tiny-drafter"
    curve = cost_curve(redrafter, 2, (4, 5))
    assert curve.sizes == list(SIZES) and len(curve.seconds) == len(SIZES)
    assert all(b >= a > 0 for a, b in zip(curve.seconds, curve.seconds[1:]))
    assert curve.draft_seconds > 0 and curve.plain_seconds > 0
    assert curve.long_context > curve.context and curve.long_sizes == [n for n in LONG_SIZES if n in SIZES]
    assert len(curve.long_seconds) == len(curve.long_sizes) and all(t > 0 for t in curve.long_seconds)
    assert capsys.readouterr().err.startswith("measuring this machine's verification cost")  # announced
    saved = json.loads(cache_path().read_text())
    assert len(saved) == 2  # the curve, and the beam search's cost for this drafter and shape
    curve_entry = next(v for k, v in saved.items() if "drafter" not in k)
    assert curve_entry["step_seconds"] == curve.step_seconds and curve_entry["plain_seconds"] == curve.plain_seconds

    again = cost_curve(redrafter, 2, (4, 5))
    assert again == curve  # from the cache, steps' costs included
    assert capsys.readouterr().err == ""
    assert len(json.loads(cache_path().read_text())) == 2
    cost_curve(redrafter, 1, (4, 5))
    assert len(json.loads(cache_path().read_text())) == 4  # another batch size is another curve

    cache_path().write_text("{not json")
    rebuilt = cost_curve(redrafter, 2, (4, 5))
    assert "cost cache" in capsys.readouterr().err
    assert len(rebuilt.seconds) == len(SIZES) and len(json.loads(cache_path().read_text())) == 2

    key = next(k for k in json.loads(cache_path().read_text()) if "drafter" not in k)
    cache_path().write_text(
        json.dumps(
            {
                key: {
                    "sizes": [1, 2],
                    "seconds": "fast",
                    "step_seconds": 0,
                    "plain_seconds": 1,
                    "context": 128,
                    "long_context": 512,
                    "long_sizes": [1],
                    "long_seconds": [1],
                }
            }
        )
    )
    cost_curve(redrafter, 2, (4, 5))
    assert "bad entry" in capsys.readouterr().err

    refreshed = cost_curve(redrafter, 2, (4, 5), refresh=True)
    assert len(refreshed.seconds) == len(SIZES)

    entry = json.loads(cache_path().read_text())[key]
    del entry["long_seconds"]  # a curve cached before contexts were measured
    cache_path().write_text(json.dumps({key: entry}))
    assert cost_curve(redrafter, 2, (4, 5)).long_seconds is not None
    assert capsys.readouterr().err.startswith("measuring this machine's verification cost")


def test_a_curve_moves_with_the_context_along_its_two_measurements():
    curve = CostCurve(
        [1, 4, 8],
        [1.0, 1.2, 1.6],
        step_seconds=0.1,
        plain_seconds=0.9,
        context=128,
        long_context=512,
        long_sizes=[1, 8],
        long_seconds=[1.0, 2.0],
    )
    assert curve.at(100) is curve and curve.at(128) is curve  # never below the shorter context's
    half = curve.at(320)  # half-way: each size half-way to the longer context's (interpolated there)
    assert half.seconds == pytest.approx([1.0, 1.2 + 0.5 * (1 + 3 / 7 - 1.2), 1.8])
    assert half.plain == pytest.approx(0.9) and half.step_seconds == 0.1
    far = curve.at(896)  # past the longer context: extrapolated along the same line
    assert far.seconds[-1] == pytest.approx(1.6 + 2 * 0.4) and far.at(2000) is far  # (a moved curve moves no further)
    assert curve.at(300) is curve.at(310)  # one curve per step of context
    no_slope = CostCurve([1, 4], [1.0, 2.0], long_sizes=[1, 4], long_seconds=[0.5, 2.5])
    moved = no_slope.at(no_slope.long_context)
    assert moved.seconds[0] == 1.0 and moved.seconds[1] == pytest.approx(
        2.5
    )  # a faster long pass (noise) moves nothing
    assert CostCurve([1, 4], [1.0, 2.0]).at(4096).seconds == [1.0, 2.0]  # no longer context measured: the curve holds

"""The measured cost curve and its cache on disk."""

import json

from conftest import tiny_redrafter

from redrafter_mlx.drafting.cost import SIZES, cache_path
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
    cache_path().write_text(json.dumps({key: {"sizes": [1, 2], "seconds": "fast", "step_seconds": 0, "plain_seconds": 1}}))
    cost_curve(redrafter, 2, (4, 5))
    assert "bad entry" in capsys.readouterr().err

    refreshed = cost_curve(redrafter, 2, (4, 5), refresh=True)
    assert len(refreshed.seconds) == len(SIZES)


def test_the_drift_check_holds_plain_steps_apart_and_finds_a_busier_machine():
    from redrafter_mlx.engine.calibrate import DriftCheck

    steady = DriftCheck()
    for _ in range(20):
        steady.add(4, 1.1, 1.0)  # drafting steps, a little above the curve
        steady.add(1, 1.3, 1.0, plain=True)  # plain steps: their own bucket, not compared with the trees'
    assert not steady.drifted()
    busier = DriftCheck()
    for _ in range(20):
        busier.add(1, 2.6, 1.0, plain=True)
    assert busier.drifted()
    freer = DriftCheck()
    for _ in range(20):
        freer.add(8, 0.5, 1.0)
    assert freer.drifted()

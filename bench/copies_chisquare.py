"""Chi-square of 4,000 copies of one prompt against the exact distribution
of their first two tokens, on the tests' tiny chat model (built as the
tests build it): ReDrafter at 1x3 and 4x3, every copy with one seed (the
behaviour before row seeds), and the reference P/Q, longest-beam rule.

    python3 bench/copies_chisquare.py
"""
import itertools
import pathlib
import sys
import tempfile

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent / 'tests'))
import conftest  # noqa: E402  (also preloads OpenBLAS before mlx.core)
import numpy as np  # noqa: E402
import test_sampling as T  # noqa: E402
from scipy.stats import chisquare  # noqa: E402

from redrafter_mlx.api import batch_generate  # noqa: E402
from redrafter_mlx.loading import load  # noqa: E402
from redrafter_mlx.sampling import SamplingSettings, make_chooser  # noqa: E402


class TempFolders:
    """What the fixture asks of pytest's tmp_path_factory."""

    def mktemp(self, name):
        return pathlib.Path(tempfile.mkdtemp(prefix=name))


model, drafter, prompt, exact, q = conftest.chat_model.__wrapped__(TempFolders())
r, tok = load(model, drafter)


def stat(counts, joint):
    """Chi-square as the tests compute it (cells expected below 5 merged)."""
    e = joint.ravel() * counts.sum()
    o = counts.ravel().astype(float)
    big, small = e >= 5, (e < 5) & (e > 0)
    ee = np.append(e[big], e[small].sum()) if small.any() else e[big]
    oo = np.append(o[big], o[small].sum()) if small.any() else o[big]
    res = chisquare(oo, ee * oo.sum() / ee.sum())
    return f"chi2 {res.statistic:.1f}, {len(ee) - 1} df, p {res.pvalue:.3g}"


for i, st in enumerate(conftest.CHAT_SETTINGS):
    joint = T.copies_exact_distribution(exact[i])
    for shape in [(1, 3), (4, 3)]:
        res = batch_generate(r, tok, [conftest.CHAT_PROMPT] * 4000, 2, batch_size=500, beam_width=shape[0], beam_length=shape[1], choose=make_chooser(SamplingSettings(**st, seed=5)))
        print(st, shape, "batch_generate:", stat(T.pair_counts([x.tokens for x in res], len(joint)), joint))
    # the shared-seed behaviour before the fix: every copy with one seed
    res = batch_generate(r, tok, [conftest.CHAT_PROMPT] * 4000, 2, batch_size=500, beam_width=4, beam_length=3, choose=make_chooser(SamplingSettings(**st, row_seeds=[5] * 4000)))
    print(st, "one seed for all copies (the old behaviour):", stat(T.pair_counts([x.tokens for x in res], len(joint)), joint))
    p1, p2 = exact[i]
    qq = np.zeros(len(p1)); qq[list(q)] = list(q.values())
    beams = sorted(itertools.product(q, repeat=2), key=lambda ab: -(qq[ab[0]] * qq[ab[1]]))[:4]
    rng = np.random.default_rng(1)
    samples = [T.reference_rule_sample(lambda prefix: p2[prefix[0]] if prefix else p1, beams, qq, 2, rng) for _ in range(4000)]
    print(st, "reference P/Q rule:", stat(T.pair_counts(samples, len(joint)), joint))

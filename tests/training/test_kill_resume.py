"""The long jobs killed with SIGKILL at random points of their own run end,
once run again, with exactly what an uninterrupted run writes, and leave no
folder that loads as a drafter: the short version of bench/kill_resume.py
(make-drafter's is in test_make_drafter)."""

import os
import sys

from conftest import ROOT

sys.path.insert(0, os.path.join(ROOT, "bench"))

import kill_resume  # noqa: E402


def test_distill_train_and_datastore_killed_at_random_points_resume_to_the_same_bytes():
    summary = kill_resume.run(["distill", "train", "datastore"], points=2, seed=1, say=lambda line: None)
    for name, job in summary["jobs"].items():
        assert job["identical"] == job["trials"], (name, job["each"])
        assert job["killed"] == 2 and job["left_loadable"] == 0, (name, job["each"])

"""The serving process around the server: how many files it may open."""

import resource

from redrafter_mlx.serving.process import allow_open_files


def test_the_soft_limit_on_open_files_is_raised_toward_the_hard_limit_and_never_lowered():
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (512, hard))
        assert allow_open_files(100) == 512  # enough already: left as it is
        assert resource.getrlimit(resource.RLIMIT_NOFILE) == (512, hard)
        wanted = 1024 if hard == resource.RLIM_INFINITY else min(1024, hard)
        assert allow_open_files(1024) == wanted
        assert resource.getrlimit(resource.RLIMIT_NOFILE) == (wanted, hard)
        if hard != resource.RLIM_INFINITY:
            assert allow_open_files(hard + 1000) == hard  # no further than the hard limit
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))

"""Repo-wide pytest options: ``--stage NAME`` restricts the shared suite to one stage package; every test run checks
the schedulers' KV pages in depth whenever they go idle (servers the tests start inherit the switch)."""

import os

os.environ.setdefault("MINISGL_CHECK_CACHE_DEEP", "1")


def pytest_addoption(parser):
    parser.addoption("--stage", action="append", default=[], help="run the shared suite for this stage only")

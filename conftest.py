"""Repo-wide pytest options: ``--stage NAME`` restricts the shared suite to one stage package."""


def pytest_addoption(parser):
    parser.addoption("--stage", action="append", default=[], help="run the shared suite for this stage only")

"""The isolation check itself: clean on the repo, and it catches a cross-stage import."""

import importlib.util
from pathlib import Path

spec = importlib.util.spec_from_file_location("stages_tool", Path(__file__).resolve().parents[1] / "stages.py")
stages_tool = importlib.util.module_from_spec(spec)
spec.loader.exec_module(stages_tool)


def test_repo_stages_are_isolated():
    assert stages_tool.check() == []


def test_cross_stage_import_is_reported(tmp_path, monkeypatch):
    for name in ("stage0_tiny", "stage1_correct"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "__init__.py").write_text("")
    (tmp_path / "stage1_correct" / "bad.py").write_text("from stage0_tiny import tiny\nimport torch\n")
    monkeypatch.setattr(stages_tool, "REPO", tmp_path)
    problems = stages_tool.check()
    assert len(problems) == 1 and "stage0_tiny" in problems[0]


# -- chapters: the topic map, drift, diff ------------------------------------------------------------------------
chapters = stages_tool.chapters
REPO = Path(__file__).resolve().parents[2]

ENGINE_V1 = '''"""The engine."""


class Engine:
    def __init__(self):
        self.pages = 1

    def step(self):
        return self.pages

    def close(self):
        return None
'''

ENGINE_V2 = '''"""The engine."""
from .kernels import fast


class Engine:
    def __init__(self):
        self.pages = 1
        self.tp = 2  # tp

    def step(self):
        return fast(self.pages)

    def close(self):
        return None
'''


def make_repo(root: Path, map_text: str, engine_v2: str = ENGINE_V2, readme2: str = "# stage1\n") -> Path:
    (root / "tools").mkdir(parents=True, exist_ok=True)
    (root / "tools" / "chapters.toml").write_text(map_text)
    for name, files in {
        "stage0_a": {"__init__.py": "", "engine.py": ENGINE_V1, "tests/test_engine.py": "x = 1\n",
                     "README.md": "# stage0\n"},
        "stage1_b": {"__init__.py": "", "engine.py": engine_v2, "kernels.py": "def fast(x):\n    return x\n",
                     "tests/test_engine.py": "x = 2\n", "README.md": readme2},
    }.items():
        for rel, text in files.items():
            (root / name / rel).parent.mkdir(parents=True, exist_ok=True)
            (root / name / rel).write_text(text)
    return root


GOOD_MAP = """
[stage1.kernels]
about = "fast kernels"
claims = ["kernels.py", "engine.py~fast"]

[stage1.tp]
about = "tensor parallelism"
claims = ["engine.py~tp", "tests/test_engine.py"]
"""


def test_repo_every_change_between_adjacent_stages_is_in_its_chapter():
    """Every file that differs between adjacent stages (stage3 -> stage4 included) belongs to a topic, no selector of
    tools/chapters.toml is stale, the READMEs' "unchanged" claims hold and their topic tables are current."""
    problems = chapters.drift(REPO) + chapters.unchanged_claim_problems(REPO) + chapters.topic_table_problems(REPO)
    assert problems == [], "\n\n".join(problems)


def test_clean_map_has_no_drift(tmp_path):
    assert chapters.drift(make_repo(tmp_path, GOOD_MAP)) == []


def test_a_fix_in_one_copy_only_is_drift_and_the_message_says_what_to_add(tmp_path):
    fixed = ENGINE_V2.replace("return None", "return self.pages  # fixed here only")
    repo = make_repo(tmp_path, GOOD_MAP, engine_v2=fixed)
    problems = chapters.drift(repo)
    assert len(problems) == 1
    assert "stage1_b/engine.py:14 (Engine.close)" in problems[0]
    assert "in no topic of stage 1's chapter" in problems[0]
    assert "stage0_a's copy and stage1_b's the same" in problems[0]
    # the suggested selector, added as one line to a topic, makes the change part of the chapter
    suggestion = problems[0].split("]:\n", 1)[1].splitlines()[0].strip().rstrip(",")
    assert suggestion == "'engine.py~fixed'"
    fixed_map = GOOD_MAP.replace('"tests/test_engine.py"]', f'"tests/test_engine.py", {suggestion}]')
    (repo / "tools" / "chapters.toml").write_text(fixed_map)
    assert chapters.drift(repo) == []


def test_a_new_file_in_no_topic_names_the_line_to_add(tmp_path):
    repo = make_repo(tmp_path, GOOD_MAP)
    (repo / "stage1_b" / "fp8.py").write_text("SCALE = 1.0\n")
    (problem,) = chapters.drift(repo)
    assert problem.startswith("stage1_b/fp8.py:1 (a new file)")
    assert '"fp8.py",' in problem


def test_a_stale_selector_is_reported(tmp_path):
    problems = chapters.drift(make_repo(tmp_path, GOOD_MAP.replace('"kernels.py",', '"kernels.py", "gone.py",')))
    assert problems == ["tools/chapters.toml [stage1.kernels]: 'gone.py' selects no change between stage0_a and "
                        "stage1_b (stale: remove it or fix its path)"]


def test_hunk_selectors_win_over_files_and_exact_paths_over_wildcards(tmp_path):
    repo = make_repo(tmp_path, """
[stage1.a]
claims = ["*", "engine.py"]
[stage1.b]
claims = ["engine.py::Engine.step"]
[stage1.c]
claims = ["kernels.py"]
""")
    chapter = chapters.load_map(repo)[1]
    owners = {(fd.path, h.new_span): chapter.owners(h) for fd in chapters.pair_diff(repo, 0, 1, "drift")
              for h in fd.hunks}
    assert owners[("engine.py", (1, 2))] == ["a"]  # the import: only the whole-file claim takes it
    assert owners[("engine.py", (10, 11))] == ["b"]  # inside Engine.step
    assert owners[("kernels.py", (0, 2))] == ["c"]  # a new file: the exact path beats the wildcard
    # a wildcard selects new files only: the test file exists in both stages, so its change is in no topic
    assert owners[("tests/test_engine.py", (0, 1))] == []


def test_diff_of_one_topic_shows_its_hunks_only(tmp_path, monkeypatch):
    monkeypatch.setattr(stages_tool, "REPO", make_repo(tmp_path, GOOD_MAP))
    text = stages_tool.diff(0, 1, topic="tp")
    assert "+        self.tp = 2  # tp" in text and "fast" not in text.split("\n\n", 1)[1]
    assert "tests and READMEs left out" in text and "test_engine" not in text
    assert "x = 2" in stages_tool.diff(0, 1, topic="tp", include="all")
    whole = stages_tool.diff(0, 1)
    assert "fast(self.pages)" in whole and "self.tp = 2" in whole and "README.md" not in whole


def test_diff_summary_comes_first_with_topics(tmp_path, monkeypatch):
    monkeypatch.setattr(stages_tool, "REPO", make_repo(tmp_path, GOOD_MAP))
    summary = stages_tool.diff(0, 1, stat=True)
    assert summary.splitlines()[0] == ("stage0_a -> stage1_b: 2 files differ, +5 -1 lines; tests and READMEs left out "
                                       "(--all shows them)")
    assert any(line.split()[:2] == ["kernels", "2"] for line in summary.splitlines())
    assert "---" not in summary


def test_diff_of_a_stage_that_does_not_exist_is_a_clean_error(capsys):
    assert stages_tool.main(["diff", "3", "9"]) == 2
    assert capsys.readouterr().err == "error: no stage 9 (the stages are 0, 1, 2, 3, 4)\n"
    assert stages_tool.main(["diff", "3", "4", "--topic", "nope"]) == 2
    assert "has no topic 'nope' (topics: tp," in capsys.readouterr().err


def test_readme_unchanged_claims_are_checked(tmp_path):
    readme = "Unchanged from stage0 (byte for byte apart from the package name): `kernels.py`, `engine.py`.\n"
    repo = make_repo(tmp_path, GOOD_MAP, readme2=readme)
    problems = chapters.unchanged_claim_problems(repo)
    assert problems == [
        "stage1_b/README.md: says `kernels.py` is unchanged from stage0_a, which has no such path",
        "stage1_b/README.md: says `engine.py` is unchanged from stage0_a, but engine.py differs",
    ]
    (repo / "stage1_b" / "README.md").write_text("Unchanged from stage0: `tests/`.\n")
    assert chapters.unchanged_claim_problems(repo) == [
        "stage1_b/README.md: says `tests/` is unchanged from stage0_a, but tests/test_engine.py differs"]


def test_readme_topic_table_is_checked_and_written(tmp_path):
    repo = make_repo(tmp_path, GOOD_MAP, readme2="# stage1\n\n<!-- topics -->\nold\n<!-- /topics -->\n")
    assert chapters.topic_table_problems(repo) == [
        "stage1_b/README.md: the topic table is not tools/chapters.toml's (run: python tools/stages.py topics --write)"]
    assert chapters.topic_table_problems(repo, write=True) == []
    assert chapters.topic_table_problems(repo) == []
    text = (repo / "stage1_b" / "README.md").read_text()
    assert "| `kernels` | fast kernels | +4 -1 |" in text  # kernels.py whole, engine.py's fast hunk


def test_a_statement_added_next_to_a_chapter_change_is_a_hunk_of_its_own(tmp_path):
    """Two flags added side by side: one is the chapter's, the other (say, another topic's new flag) is not."""
    v2 = ENGINE_V2.replace("        self.tp = 2  # tp\n", "        self.tp = 2  # tp\n        self.kv_dtype = 'fp8'\n")
    (problem,) = chapters.drift(make_repo(tmp_path, GOOD_MAP, engine_v2=v2))
    assert problem.startswith("stage1_b/engine.py:9 (Engine.__init__)")
    assert "'engine.py~kv_dtype'," in problem


def test_a_moved_block_lands_on_whole_statements():
    """`@property / def a / ... / @property / def b`: the inserted property is one hunk, not a cut through two."""
    old = ["class C:\n", "    @property\n", "    def b(self):\n", "        return 2\n"]
    new = ["class C:\n", "    @property\n", "    def a(self):\n", "        return 1\n", "\n",
           "    @property\n", "    def b(self):\n", "        return 2\n"]
    (hunk,) = chapters._hunks("c.py", old, new, whole_file=False)
    assert hunk.added == new[1:5] and hunk.symbols == {"C.a"}


def test_suggested_claims_cover_every_unclaimed_hunk(tmp_path):
    v2 = ENGINE_V2.replace("        self.tp = 2  # tp\n", "        self.tp = 2  # tp\n        self.kv_dtype = 'fp8'\n")
    repo = make_repo(tmp_path, GOOD_MAP, engine_v2=v2)
    (repo / "stage1_b" / "fp8.py").write_text("SCALE = 1.0\n")
    suggested = chapters.suggest_claims(repo, 1)
    assert suggested == ['"fp8.py"', "'engine.py~kv_dtype'"]
    fixed_map = GOOD_MAP + '\n[stage1.fp8-kv]\nclaims = [' + ", ".join(suggested) + "]\n"
    (repo / "tools" / "chapters.toml").write_text(fixed_map)
    assert chapters.drift(repo) == []


# -- exact topics: every hunk in exactly one topic ---------------------------------------------------------------
def test_repo_every_hunk_of_every_adjacent_pair_is_in_exactly_one_topic():
    """For every adjacent stage pair, tests included: no hunk is unclaimed and none is claimed by two topics (hunk
    selectors winning over whole-file ones is by design, not a double claim)."""
    maps, dirs = chapters.load_map(REPO), chapters.stage_dirs(REPO)
    unclaimed, double = [], []
    for b in sorted(dirs):
        if b - 1 not in dirs:
            continue
        chapter = maps[b]
        for fd in chapters.pair_diff(REPO, b - 1, b, include="drift"):
            for hunk in fd.hunks:
                owners = chapter.owners(hunk)
                if not owners:
                    unclaimed.append(f"stage{b} {hunk.location()}")
                elif len(owners) > 1:
                    double.append(f"stage{b} {hunk.location()}: {owners}")
        assert not chapters.double_file_claims(chapter)
    assert unclaimed == [], "\n".join(unclaimed)
    assert double == [], "\n".join(double)


def test_two_topics_claiming_one_hunk_is_reported_with_both_names(tmp_path):
    repo = make_repo(tmp_path, GOOD_MAP.replace('"engine.py~tp"', '"engine.py~tp", "engine.py::Engine.step"'))
    (problem,) = chapters.drift(repo)
    assert problem.startswith("stage1_b/engine.py:11 (Engine.step): claimed by two topics of stage 1's chapter: ")
    assert "[stage1.kernels] 'engine.py~fast'" in problem and "[stage1.tp] 'engine.py::Engine.step'" in problem
    assert stages_tool.main(["drift"]) in (0, 1)  # the command runs on the real map either way


def test_a_hunk_selector_of_one_topic_beside_another_topics_whole_file_is_no_double_claim(tmp_path):
    repo = make_repo(tmp_path, """
[stage1.a]
claims = ["engine.py", "kernels.py", "tests/test_engine.py"]
[stage1.b]
claims = ["engine.py::Engine.step"]
""")
    assert chapters.drift(repo) == []


def test_two_topics_claiming_one_file_whole_is_reported(tmp_path):
    repo = make_repo(tmp_path, GOOD_MAP + '\n[stage1.other]\nclaims = ["kernels.py"]\n')
    problems = chapters.drift(repo)
    assert problems[-1] == ("tools/chapters.toml: 'kernels.py' is claimed as a whole file by two topics of stage 1's "
                            "chapter: kernels, other (keep it in one; hand single hunks to the others with hunk "
                            "selectors)")
    assert any(p.startswith("stage1_b/kernels.py:1-2 (a new file): claimed by two topics") for p in problems)


def test_a_new_files_definitions_can_belong_to_two_topics(tmp_path, monkeypatch):
    """A new file is split into its top-level statements and a class's members, so one method can be a topic's."""
    repo = make_repo(tmp_path, """
[stage1.engine]
claims = ["engine.py", "kernels.py", "tests/test_engine.py"]
[stage1.engine-new]
claims = ["sched.py"]
[stage1.loop]
claims = ["sched.py::Sched.loop"]
""")
    (repo / "stage1_b" / "sched.py").write_text(
        "import os\n\n\nclass Sched:\n    x = 1\n\n    def loop(self):\n        return os.sep\n\n"
        "    def stop(self):\n        return None\n")
    assert chapters.drift(repo) == []
    monkeypatch.setattr(stages_tool, "REPO", repo)
    text = stages_tool.diff(0, 1, topic="loop")
    assert "+    def loop(self):" in text and "def stop" not in text and "import os" not in text
    assert "@@ -0,0 +6,3 @@" in text
    whole = stages_tool.diff(0, 1, topic="engine-new")
    assert "def stop" in whole and "def loop" not in whole


def test_chapters_lists_every_topic_in_reading_order_with_its_size(tmp_path, monkeypatch):
    monkeypatch.setattr(stages_tool, "REPO", make_repo(tmp_path, GOOD_MAP))
    lines = stages_tool.chapter_list().splitlines()
    assert lines[0].split()[:5] == ["stage", "topic", "files", "+lines", "-lines"]
    assert [line.split()[:5] for line in lines[1:]] == [["1", "kernels", "2", "4", "1"], ["1", "tp", "1", "1", "0"]]


def test_repo_chapters_cover_every_stage_in_order(capsys):
    assert stages_tool.main(["chapters"]) == 0
    rows = [line.split()[:2] for line in capsys.readouterr().out.splitlines()[1:]]
    assert [int(stage) for stage, _ in rows] == sorted(int(stage) for stage, _ in rows)
    assert rows[0] == ["1", "core"] and ["2", "overlap"] in rows and ["3", "scheduler-io"] in rows


def test_an_exclusion_leaves_a_hunk_to_the_other_topic(tmp_path):
    both = GOOD_MAP.replace('"engine.py~tp"', '"engine.py~tp", "engine.py::Engine.step"')
    repo = make_repo(tmp_path, both.replace('"engine.py~fast"]', '"engine.py~fast", "!engine.py::Engine.step"]'))
    assert chapters.drift(repo) == []
    chapter = chapters.load_map(repo)[1]
    owners = {h.new_span: chapter.owners(h) for fd in chapters.pair_diff(repo, 0, 1, "drift") for h in fd.hunks
              if fd.path == "engine.py"}
    assert owners[(1, 2)] == ["kernels"] and owners[(10, 11)] == ["tp"]
    # an exclusion that takes nothing from its topic is stale like any selector
    stale = both.replace('"engine.py~fast"]', '"engine.py~fast", "!engine.py::Engine.close"]')
    (repo / "tools" / "chapters.toml").write_text(stale)
    assert any("'!engine.py::Engine.close' selects no change" in p for p in chapters.drift(repo))


def test_two_paragraphs_added_to_a_docstring_are_two_hunks():
    old = ['"""The module.\n', '"""\n', "X = 1\n"]
    new = ['"""The module.\n', "\n", "FP8: the pool's dtype.\n", "\n", "Graphs: fixed buffers.\n", '"""\n', "X = 1\n"]
    hunks = chapters._hunks("m.py", old, new, whole_file=False)
    assert [h.added for h in hunks] == [new[1:3], new[3:5]]

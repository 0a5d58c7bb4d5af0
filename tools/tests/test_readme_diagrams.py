"""The stage READMEs' mermaid diagrams name only what exists in that stage.

Convention: inside a ```mermaid block, a word written like code — with an underscore (`match_prefix`,
`DISABLE_OVERLAP_SCHEDULING`), in CamelCase (`UserMsg`), dotted (`GraphRunner.replay`) or called (`evict()`) — is a
name from the stage's source: a class, function, method, attribute, field or argument defined somewhere in the
stage (tests excluded). Dotted names whose first part is a class of the stage name a member of that class. Node ids
are short lower-case words, so they are never taken for names. Names of other projects go in EXTERNAL.
"""

from __future__ import annotations

import ast
import re
from collections import defaultdict
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
STAGES = sorted(p for p in REPO.glob("stage[0-9]_*") if (p / "__init__.py").exists())
EXTERNAL = {"FastAPI", "FlashInfer", "FlashAttention", "PyTorch", "OpenAI"}
WORD = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(?:\.[A-Za-z_][A-Za-z0-9_]*)*(?:\(\))?")
CAMEL = re.compile(r"[A-Z][a-z0-9]+(?:[A-Z][a-z0-9]*)+")


def mermaid_blocks(readme: Path) -> list[str]:
    return re.findall(r"```mermaid\n(.*?)```", readme.read_text(), flags=re.S)


def code_names(text: str) -> set[str]:
    names = set()
    for word in WORD.findall(text):
        called = word.endswith("()")
        word = word.removesuffix("()")
        parts = word.split(".")
        if called or len(parts) > 1 or "_" in word or any(CAMEL.fullmatch(p) for p in parts):
            names.add(word)
    return names - EXTERNAL


def defined_names(stage: Path) -> tuple[set[str], dict[str, set[str]]]:
    """Every name the stage defines, and for each class the names defined inside it."""
    names: set[str] = set()
    members: dict[str, set[str]] = defaultdict(set)

    def add(node: ast.AST, into: set[str]) -> None:
        if isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            into.add(node.name)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            into.add(node.id)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
            into.add(node.attr)
        elif isinstance(node, ast.arg):
            into.add(node.arg)

    for path in stage.rglob("*.py"):
        if "tests" in path.relative_to(stage).parts:
            continue
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            add(node, names)
            if isinstance(node, ast.ClassDef):
                for inner in ast.walk(node):
                    add(inner, members[node.name])
    return names, members


def missing_names(stage: Path, text: str) -> list[str]:
    names, members = defined_names(stage)
    missing = []
    for name in sorted(code_names(text)):
        head, *rest = name.split(".")
        if head in members and rest:
            ok = all(part in members[head] for part in rest)
        else:
            ok = all(part in names for part in name.split("."))
        if not ok:
            missing.append(name)
    return missing


@pytest.mark.parametrize("stage", STAGES, ids=lambda p: p.name)
def test_every_name_in_a_diagram_exists_in_its_stage(stage: Path):
    for block in mermaid_blocks(stage / "README.md"):
        assert missing_names(stage, block) == [], f"{stage.name}/README.md diagram:\n{block}"


def test_the_diagrams_are_there():
    counts = {stage.name: len(mermaid_blocks(stage / "README.md")) for stage in STAGES}
    assert counts["stage1_correct"] >= 3  # Req / Batch / Context, the paged KV pool, the attention backend's calls
    # a scheduler step, admission and page allocation, chunked prefill, the radix tree, the overlap timeline
    assert counts["stage2_scheduled"] >= 5
    assert counts["stage3_served"] >= 2  # the processes and their messages, a request's life
    # the TP splits, FlashInfer's plan / run, the CUDA-graph buffers, the MoE dispatch, the hybrid's state pool
    assert counts["stage4_fast"] >= 5


def test_a_renamed_function_is_caught():
    stage = REPO / "stage2_scheduled"
    assert missing_names(stage, 'a["RadixPrefixCache.match_prefix()"] --> b["split_at"]') == []
    assert missing_names(stage, 'a["RadixPrefixCache.match_prefixes()"] --> b["UserMessage"]') == [
        "RadixPrefixCache.match_prefixes", "UserMessage"]
    assert missing_names(stage, "flowchart LR\n  sched --> step") == []  # plain words are not names

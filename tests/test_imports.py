"""The package's import graph has no cycles, counting imports inside functions too (so no lazy import
can hide one), and the rollout code depends on the task protocol alone."""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"


def import_graph(src: Path, package: str) -> dict[str, set[str]]:
    """Module -> the package's modules it imports (anywhere in its code). Importing ``a.b.c`` runs
    ``a.b``'s ``__init__`` too, so each import also counts for the packages above it, except the
    importing module's own packages, which Python has already started."""
    modules = {}
    for path in (src / package).rglob("*.py"):
        parts = list(path.relative_to(src).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        modules[".".join(parts)] = path
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        targets = []
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets += [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                targets += [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        edges = set()
        for target in targets:
            parts = target.split(".")
            for i in range(2, len(parts) + 1):
                dep = ".".join(parts[:i])
                if dep in modules and dep != name and not name.startswith(dep + "."):
                    edges.add(dep)
        graph[name] = edges
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every back edge's cycle found by a depth-first search (empty when the graph is acyclic)."""
    found, state, stack = [], {}, []

    def visit(u: str) -> None:
        state[u] = "open"
        stack.append(u)
        for v in sorted(graph[u]):
            if state.get(v) == "open":
                found.append(stack[stack.index(v):] + [v])
            elif v not in state:
                visit(v)
        stack.pop()
        state[u] = "done"

    for u in sorted(graph):
        if u not in state:
            visit(u)
    return found


def test_the_checker_finds_a_cycle_through_a_package_init_and_a_lazy_import(tmp_path):
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("from pkg.sub.b import B\n")
    (pkg / "sub" / "b.py").write_text("B = 1\n")
    (pkg / "a.py").write_text("def f():\n    from pkg.sub.b import B\n    return B\n")
    assert cycles(import_graph(tmp_path, "pkg")) == []
    (pkg / "sub" / "b.py").write_text("def g():\n    import pkg.a\n")  # a -> pkg.sub -> b -> a
    assert cycles(import_graph(tmp_path, "pkg")) == [["pkg.a", "pkg.sub", "pkg.sub.b", "pkg.a"]]


def test_emapg_has_no_import_cycle():
    assert cycles(import_graph(SRC, "emapg")) == []


# The layers of docs/ARCHITECTURE.md, bottom first: a module imports only from its own layer or below.
LAYERS = [
    ("foundations", ["emapg", "emapg.errors", "emapg.atomic", "emapg.data", "emapg.tags", "emapg.kl", "emapg.objective",
                     "emapg.rollout.sampling", "emapg.rewards",
                     "emapg.rewards.magnitude", "emapg.rewards.math", "emapg.rewards.math_reference",
                     "emapg.rewards.qa", "emapg.tasks.base", "emapg.tasks.multihop_kb",
                     "emapg.retrieval.client", "emapg.integrations", "emapg.stats", "emapg.backends",
                     "emapg.rollout.vllm_settings", "emapg.models", "emapg.settings",
                     "emapg.run", "emapg.lab"]),
    ("config", ["emapg.config.schema", "emapg.config.rules", "emapg.config.loading", "emapg.config",
                "emapg.config.reference", "emapg.kl_moments"]),
    ("models and state", ["emapg.models.lm", "emapg.models.distributed", "emapg.models.zoo", "emapg.anchor",
                          "emapg.run.shards", "emapg.run.checkpoint", "emapg.run.export", "emapg.run.metrics",
                          "emapg.run.outcomes", "emapg.run.folder", "emapg.lab.spec"]),
    ("tasks and retrieval", ["emapg.retrieval", "emapg.retrieval.passages", "emapg.retrieval.bm25",
                             "emapg.retrieval.embed", "emapg.retrieval.dense", "emapg.retrieval.hybrid",
                             "emapg.retrieval.server", "emapg.tasks", "emapg.tasks.arithmetic", "emapg.tasks.math",
                             "emapg.tasks.search_qa"]),
    ("rollout", ["emapg.rollout", "emapg.rollout.hf",
                 "emapg.rollout.agent", "emapg.rollout.prompts", "emapg.rollout.vllm_backend"]),
    ("the step", ["emapg.algo", "emapg.models.forward",
                  "emapg.run.evaluate",
                  "emapg.models.plan",
                  "emapg.run.teacher_kl"]),
    ("run assembly", ["emapg.run.assembly"]),
    ("orchestration", ["emapg.run.trainer", "emapg.lab.study", "emapg.lab.report", "emapg.lab.verdicts",
                       "emapg.run.evalsuite", "emapg.integrations.trl"]),
    ("command line", ["emapg.cli", "emapg.commands", "emapg.launcher", "emapg.__main__"]),
]


def arrows_up(graph: dict[str, set[str]], layers: list[tuple[str, list[str]]]) -> list[str]:
    """Every import from a module to one in a higher layer, and every module in no layer."""
    level = {m: i for i, (_, mods) in enumerate(layers) for m in mods}
    found = [f"{m}: in no layer" for m in sorted(graph) if m not in level]
    found += [f"{m} ({layers[level[m]][0]}) -> {d} ({layers[level[d]][0]})" for m in sorted(graph)
              for d in sorted(graph[m]) if m in level and d in level and level[d] > level[m]]
    return found


def test_the_checker_finds_an_arrow_running_up():
    graph = {"a": {"b"}, "b": set(), "c": set()}
    assert arrows_up(graph, [("low", ["a", "c"]), ("high", ["b"])]) == ["a (low) -> b (high)"]
    assert arrows_up(graph, [("low", ["b"]), ("high", ["a"])]) == ["c: in no layer"]


def test_no_import_arrow_runs_up_a_layer():
    assert arrows_up(import_graph(SRC, "emapg"), LAYERS) == []


def reach(graph: dict[str, set[str]], start: str) -> set[str]:
    """Every module ``start`` imports, directly or through others."""
    seen, todo = set(), [start]
    while todo:
        for d in graph[todo.pop()] - seen:
            seen.add(d)
            todo.append(d)
    return seen


STEP = {"emapg.run.trainer", "emapg.run.assembly", "emapg.algo", "emapg.models.forward", "emapg.rollout"}


def test_the_study_lab_and_the_training_step_do_not_import_each_other():
    """The lab reads finished run folders (metrics, outcomes, checkpoints present) and starts runs as
    processes; the RL library never imports the lab (only the command line's commands do)."""
    graph = import_graph(SRC, "emapg")
    lab = [m for m in graph if m.startswith("emapg.lab.")]
    assert len(lab) >= 3
    for m in lab:
        assert reach(graph, m) & STEP == set(), m
    importers = {m for m, deps in graph.items() if any(d.startswith("emapg.lab") for d in deps)}
    assert {m for m in importers if not m.startswith("emapg.lab")} == {"emapg.commands"}


def test_rollout_code_knows_tasks_only_through_their_protocol():
    for path in (SRC / "emapg" / "rollout").glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            for name in names:
                assert not name.startswith("emapg.tasks") or name == "emapg.tasks.base", f"{path.name}: {name}"



def test_the_retrieval_server_starts_without_torch():
    """The server raises ConfigError from emapg.errors, not through the config (which imports torch)."""
    import subprocess
    import sys

    code = "import sys, emapg.retrieval.server; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"


def test_the_command_lines_help_imports_no_torch():
    """`emapg --help` and each subcommand's --help answer at once: neither torch nor transformers is imported (it
    took 3-6 s)."""
    import subprocess
    import sys

    for args in ([], ["train"], ["eval"], ["plan"], ["compare"], ["config"], ["export"], ["index", "build"]):
        out = subprocess.run([sys.executable, "-X", "importtime", "-m", "emapg", *args, "--help"], capture_output=True,
                             text=True, timeout=60)
        assert out.returncode == 0, out.stderr[-2000:]
        loaded = {line.rsplit("|", 1)[-1].strip() for line in out.stderr.splitlines() if line.startswith("import time")}
        assert not loaded & {"torch", "transformers"}, args

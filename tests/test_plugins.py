"""Open registries: a user's own task, rollout backend, retriever, advantage and KL estimator, registered from
a module outside the package (a config's ``plugins``), are taken by `emapg train`, `emapg eval` and
`emapg serve-retriever` like the built-in ones. Each run is its own process, so the registrations never
leak into the rest of the suite."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

SMOKE = Path(__file__).resolve().parents[1] / "recipes" / "smoke.yaml"

PLUGIN = '''
"""A user's module: a task, an engine backend, a retriever, an advantage estimator and a KL estimator."""
import json
import random
from dataclasses import dataclass
from pathlib import Path

import torch

from emapg.backends import Backend, EngineMemory, backend_settings, register_backend
from emapg.kl import ESTIMATORS, Estimator, register_estimator
from emapg.objective import register_advantage
from emapg.retrieval import Passage, register_retriever
from emapg.tasks import register_task
from emapg.tasks.base import Example, Task


class Echo(Task):
    """Reward 1 when the response contains the prompt's letter."""

    ARGS = {}

    def __init__(self, letter: str = "a", eval_size: int = 4):
        self.letter, self.eval_size = letter, eval_size

    def _ex(self, i):
        return Example(id=f"e{i}", messages=[{"role": "user", "content": f"say {self.letter}"}], answer=self.letter)

    def train_examples(self, rng, n):
        return [self._ex(rng.randrange(1000)) for _ in range(n)]

    def eval_examples(self, size):
        return [self._ex(i) for i in range(min(size, self.eval_size))]

    def reward(self, completion, example):
        return float(example.answer in completion)


register_task("echo", Echo)


class LoopEngine:
    """An engine that samples with emapg's own decode loop on the weights it was last synced to, and counts
    what it was asked (into its work folder)."""

    def __init__(self, model, tokenizer, workdir):
        from emapg.rollout.sampling import eos_ids

        self.model, self.tokenizer, self.log = model, tokenizer, Path(workdir) / "calls.jsonl"
        self.log.parent.mkdir(parents=True, exist_ok=True)
        self.eos = eos_ids(model, tokenizer)

    def _note(self, **row):
        with self.log.open("a") as f:
            f.write(json.dumps(row) + "\\n")

    def sync(self, model, version):
        self._note(call="sync", version=version)
        return True

    def rollout(self, task, examples, spec, *, seed=None, device=None):  # one turn or episodes, from the two below
        from emapg.rollout import sampled_rollout

        return sampled_rollout(self, self.tokenizer, task, examples, spec, seed=seed, device=device)

    def generate(self, examples, spec, *, seed=None, device=None):
        from emapg.rollout.hf import generate

        self._note(call="generate", prompts=len(examples), n=spec.n, k=spec.k)
        return generate(self.model, self.tokenizer, examples, spec)

    def sampler(self, spec, *, stop=None, seed=None):
        raise NotImplementedError

    def after_rollout(self):
        self._note(call="after_rollout")

    def close(self):
        self._note(call="close")


@dataclass(frozen=True)
class LoopSettings:  # rollout.backend_args of the loop backend
    note: str = "none"
    share_mib: int = 64


def loop_memory(settings, params, gpu_memory, device):
    return EngineMemory(settings.share_mib * 2**20, sleeps=False, fix="a smaller rollout.backend_args.share_mib")


def for_run(cfg, model, tokenizer, task, spec, *, device, rank, rows, workdir):
    engine = LoopEngine(model, tokenizer, workdir)
    engine._note(call="start", note=backend_settings(cfg.rollout).note)
    return engine


register_backend(Backend("loop", for_run=for_run, settings=LoopSettings, memory=loop_memory))


class Keyword:
    def __init__(self, index):
        self.index = index

    def search(self, queries, topk=3):
        return [[Passage(id="0", title="kw", text=q.upper())][:topk] for q in queries]


register_retriever("keyword", lambda index, search_params: Keyword(index))


def centred(r, mean, eps):
    return r - mean


register_advantage("centred", centred)
register_estimator(Estimator("my_k3", "reverse", "none", ESTIMATORS["k3"].sample))
'''


def run(*args, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "emapg", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=600)


@pytest.fixture
def plugin(tmp_path) -> Path:
    path = tmp_path / "my_plugin.py"
    path.write_text(textwrap.dedent(PLUGIN))
    return path


def test_a_task_a_backend_an_advantage_and_an_estimator_registered_outside_the_package_train(tmp_path, plugin):
    res = run("train", "--config", str(SMOKE), "--out", "run", "plugins=[my_plugin.py]", "task=echo",
              "task_args={letter: b}", "rollout.backend=loop", "rollout.backend_args.note=mine",
              "algo.advantage=centred", "algo.kl=my_k3", "steps=2", "export=false", "eval.size=2", "save_every=0",
              cwd=tmp_path)
    assert res.returncode == 0, res.stderr[-3000:]
    calls = [json.loads(line) for line in (tmp_path / "run" / "loop" / "calls.jsonl").read_text().splitlines()]
    assert calls[0] == {"call": "start", "note": "mine"}  # its own settings, from rollout.backend_args
    calls = calls[1:]
    assert [c["call"] for c in calls] == ["sync", "generate", "after_rollout"] * 2 + ["close"]
    assert [c["version"] for c in calls if c["call"] == "sync"] == [0, 1]
    assert all(c["prompts"] == 4 and c["n"] == 4 for c in calls if c["call"] == "generate")
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "reward_mean" in r]
    assert [r["step"] for r in steps] == [1, 2] and all(r["kl"] >= 0 for r in steps)
    saved = (tmp_path / "run" / "config.yaml").read_text()
    assert "my_plugin.py" in saved and "task: echo" in saved  # a resume imports it again


def test_a_backend_registered_outside_the_package_plans_checks_its_settings_and_restarts(tmp_path, plugin):
    """A plugin backend is whole: its settings are its own (``rollout.backend_args``, checked against the dataclass
    it declares, every wrong key named in one line), ``emapg plan`` counts its engine as its ``memory`` says (and
    names its fix), and a run that stopped before its first checkpoint starts again with its engine's folder
    cleared like the rest of the run's files."""
    common = ["--config", str(SMOKE), "plugins=[my_plugin.py]", "task=echo", "task_args={letter: b}",
              "rollout.backend=loop"]
    res = run("plan", *common, "rollout.backend_args.share_mib=4096", "--gpu-memory", "2", cwd=tmp_path)
    assert "| loop engine, awake through the update | 4.00 |" in res.stdout, res.stdout + res.stderr
    assert "a smaller rollout.backend_args.share_mib" in res.stdout
    res = run("train", *common, "--out", "run", "rollout.backend_args={share_mib: x, colour: red}", cwd=tmp_path)
    assert res.returncode == 2 and "Traceback" not in res.stderr
    assert "rollout.backend_args: unknown key(s) colour; known: note, share_mib" in res.stderr
    assert "rollout.backend_args.share_mib: expected int, got 'x'" in res.stderr
    (tmp_path / "run" / "loop").mkdir(parents=True)  # a run that stopped before its first checkpoint
    (tmp_path / "run" / "loop" / "calls.jsonl").write_text('{"call": "stale"}\n')
    (tmp_path / "run" / ".emapg-run").write_text("a run folder of emapg train\n")
    res = run("train", *common, "--out", "run", "steps=1", "export=false", "eval.size=0", "save_every=0",
              cwd=tmp_path)
    assert res.returncode == 0, res.stderr[-3000:]
    calls = [json.loads(line)["call"] for line in (tmp_path / "run" / "loop" / "calls.jsonl").read_text().splitlines()]
    assert calls[0] == "start" and "stale" not in calls


def test_a_config_written_before_backend_args_reads_its_vllm_settings_there(tmp_path):
    """A run folder's config.yaml from an earlier emapg (the vllm_* fields of rollout) loads with them moved into
    rollout.backend_args where the backend is vllm, and dropped where it is not (they did nothing there); an
    override with an old name says where it went."""
    from emapg.config import ConfigError, load_config

    old = tmp_path / "old.yaml"
    old.write_text("rollout: {backend: vllm, vllm_gpu_memory: 0.7, vllm_sleep: true, backend_args: {seeds: false}}\n")
    assert load_config(old).rollout.backend_args == {"gpu_memory": 0.7, "sleep": True, "seeds": False}
    old.write_text("rollout: {backend: hf, vllm_gpu_memory: 0.3, vllm_sleep: false}\n")
    assert load_config(old).rollout.backend_args == {}
    with pytest.raises(ConfigError, match="rollout.vllm_sleep is now rollout.backend_args.sleep"):
        load_config(None, ["rollout.vllm_sleep=true"])
    with pytest.raises(ConfigError, match="backend hf.*takes no settings, got gpu_memory"):
        load_config(None, ["rollout.backend_args.gpu_memory=0.5"])
    with pytest.raises(ConfigError, match="rollout.backend_args.gpu_memory: must be in"):
        load_config(None, ["rollout.backend=vllm", "rollout.backend_args.gpu_memory=1.5"])
    # changing the backend drops what the file gave the previous one, not what the overrides give, in any order
    recipe = SMOKE.parent / "math_r1_distill_1p5b.yaml"
    assert load_config(recipe).rollout.backend_args == {"gpu_memory": 0.85, "sleep": True}
    assert load_config(recipe, ["rollout.backend=hf"]).rollout.backend_args == {}
    for order in (["rollout.backend_args.sleep=true", "rollout.backend=vllm"],
                  ["rollout.backend=vllm", "rollout.backend_args.sleep=true"]):
        assert load_config(SMOKE, order).rollout.backend_args == {"sleep": True}


def test_the_task_args_of_a_registered_task_are_checked_like_the_built_in_ones(tmp_path, plugin):
    res = run("train", "--config", str(SMOKE), "--out", "run", "plugins=[my_plugin.py]", "task=echo",
              "task_args={letter: 3, colour: red}", cwd=tmp_path)
    assert res.returncode == 2
    assert ("task_args.letter: expected a string, got 3; task_args.colour: unknown for the echo task; it takes "
            "letter, eval_size") in res.stderr and "Traceback" not in res.stderr


def test_eval_and_the_retriever_server_take_plugins_too(tmp_path, plugin):
    # refused before any model loads: a model that does not exist is never reached
    res = run("eval", "--plugins", "my_plugin.py", "--model", "no-such/model", "--task", "echo", "--size", "2",
              "--max-new-tokens", "4", "--device", "cpu", "--backend", "loop", cwd=tmp_path)
    assert res.returncode == 2 and "--backend loop: the backend samples for training only" in res.stderr
    res = run("eval", "--plugins", "my_plugin.py", "--model", "tiny-llama", "--task", "echo", "--size", "2",
              "--max-new-tokens", "4", "--device", "cpu", cwd=tmp_path)
    assert res.returncode == 0, res.stderr[-2000:]
    assert "| tiny-llama |" in res.stdout
    code = ("import sys; sys.path.insert(0, '.'); import my_plugin; from emapg.retrieval import open_retriever; "
            "print(open_retriever(index='anywhere', kind='keyword').search(['who'])[0][0].text)")
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "WHO"


@pytest.mark.parametrize(("plugins", "message"), [
    ("[nowhere.py]", "plugins: nowhere.py: no such file"),
    ("[no_such_module_here]", "plugins: no_such_module_here: No module named 'no_such_module_here'"),
    ("[broken.py]", "plugins: importing broken.py failed: ZeroDivisionError: division by zero"),
    ("7", "plugins: expected a list of module names or .py files, got 7"),
])
def test_a_plugin_that_cannot_be_imported_is_named_in_one_line(tmp_path, plugins, message):
    (tmp_path / "broken.py").write_text("x = 1 / 0\n")
    res = run("train", "--config", str(SMOKE), "--out", "run", f"plugins={plugins}", cwd=tmp_path)
    assert res.returncode == 2 and message in res.stderr and "Traceback" not in res.stderr
    assert not (tmp_path / "run").exists()


def test_a_task_that_takes_any_keyword_gets_its_task_args_unchecked_by_name():
    """A plugin task whose __init__ has **kwargs takes keys its signature does not list (it was refused); its
    named parameters are still type-checked."""
    from emapg.tasks import TASKS, Task, task_args_problems

    class Open(Task):
        name = "open_kwargs_task"

        def __init__(self, size: int = 3, **options):
            self.options = options

    TASKS["open_kwargs_task"] = Open
    try:
        assert task_args_problems("open_kwargs_task", {"size": 2, "anything": [1]}) == []
        assert task_args_problems("open_kwargs_task", {"size": "x"}) == ["task_args.size: expected an integer, got 'x'"]
    finally:
        del TASKS["open_kwargs_task"]


def test_a_registered_name_cannot_be_taken_twice():
    from emapg.backends import Backend, register_backend
    from emapg.retrieval import register_retriever
    from emapg.tasks import TASKS, register_task

    with pytest.raises(ValueError, match="'vllm' is already registered"):
        register_backend(Backend("vllm", for_run=lambda *a, **k: None))
    with pytest.raises(ValueError, match="give for_run or for_eval"):
        register_backend(Backend("nothing"))
    with pytest.raises(ValueError, match="'bm25' is already registered"):
        register_retriever("bm25", lambda index, params: None)
    with pytest.raises(ValueError, match="'math' exists already"):
        register_task("math", TASKS["arithmetic"])
    with pytest.raises(TypeError, match="expected a subclass of emapg.tasks.base.Task"):
        register_task("not_a_task", dict)


def test_a_run_folders_config_imports_no_plugin_unless_trusted_on_the_command_line(tmp_path):
    """Plugins are code: a config.yaml read from a run folder (someone else's, say) imports none for eval,
    export or a resume unless --trust-plugins is given; the refusal names the plugin and the flag, and the
    plugin's code never ran. A plugin that exits on import is named, not taken for emapg's own exit."""
    res = run("train", "--config", str(SMOKE), "--out", "run", "steps=1", "eval.size=0", cwd=tmp_path)
    assert res.returncode == 0, res.stderr[-2000:]
    (tmp_path / "evil.py").write_text("open('RAN', 'w').write('x')\n")
    config = tmp_path / "run" / "config.yaml"
    config.write_text(config.read_text().replace("plugins: []\n", "plugins: [evil.py]\n"))
    assert "plugins: [evil.py]" in config.read_text()
    (tmp_path / "mine.yaml").write_text("extends: run/config.yaml\n")  # a file of mine extending the run's
    (tmp_path / "spec.yaml").write_text("base: run/config.yaml\nconfigs: {a: []}\n")
    for args in (("eval", "--run", "run", "--size", "2", "--max-new-tokens", "2", "--device", "cpu"),
                 ("export", "run"), ("train", "--resume", "run", "steps=2"),
                 ("train", "--config", "run/config.yaml", "--out", "run3", "steps=1"),
                 ("train", "--config", "mine.yaml", "--out", "run4", "steps=1"),
                 ("plan", "--config", "run/config.yaml", "--device", "cpu"),
                 ("compare", "--spec", "spec.yaml", "--out", "cmp")):
        res = run(*args, cwd=tmp_path)
        assert res.returncode == 2, (args, res.stderr[-2000:])
        assert "it names plugins (evil.py), which are code run on import" in res.stderr and \
            "--trust-plugins" in res.stderr and "Traceback" not in res.stderr
        assert f"inside the run folder {(tmp_path / 'run').resolve()}" in res.stderr
        assert not (tmp_path / "RAN").exists()
    res = run("export", "run", "--trust-plugins", cwd=tmp_path)
    assert res.returncode == 0, res.stderr[-2000:]
    assert (tmp_path / "RAN").exists()
    (tmp_path / "RAN").unlink()
    res = run("plan", "--config", "run/config.yaml", "--device", "cpu", "--trust-plugins", cwd=tmp_path)
    assert res.returncode == 0 and (tmp_path / "RAN").exists(), res.stderr[-2000:]
    (tmp_path / "RAN").unlink()  # a file the user wrote names its plugins: they are imported
    res = run("plan", "--config", str(SMOKE), "--device", "cpu", "plugins=[evil.py]", cwd=tmp_path)
    assert res.returncode == 0 and (tmp_path / "RAN").exists(), res.stderr[-2000:]
    (tmp_path / "quits.py").write_text("import sys\nsys.exit(0)\n")
    res = run("train", "--config", str(SMOKE), "--out", "run2", "plugins=[quits.py]", cwd=tmp_path)
    assert res.returncode == 2 and "plugins: importing quits.py exited (SystemExit 0)" in res.stderr


def test_a_plugin_named_as_a_module_and_as_its_file_is_imported_once(tmp_path, plugin):
    """`plugins: [my_plugin, my_plugin.py]` is one plugin: imported once, its names registered once (twice was a
    "'echo' is already registered" error)."""
    res = run("train", "--config", str(SMOKE), "--out", "run", "plugins=[my_plugin, my_plugin.py]", "task=echo",
              "task_args={letter: b}", "steps=1", "export=false", "eval.size=0", "save_every=0", cwd=tmp_path)
    assert res.returncode == 0, res.stderr[-2000:]


BAD_TASKS = '''
from emapg.tasks import register_task
from emapg.tasks.base import Example, Task


class Undefined(Task):
    def __init__(self, size: "NoSuchType" = 4):
        self.size = size

    def train_examples(self, rng, n):
        return [Example(id=str(i), messages=[{"role": "user", "content": "say a"}], answer="a") for i in range(n)]

    def eval_examples(self, size):
        return self.train_examples(None, size)

    def reward(self, completion, example):
        return 1.0


class Stringy(Undefined):
    def __init__(self, size: int = 4, **smoke_args):  # (the smoke recipe's arithmetic arguments too)
        self.size = size

    def train_examples(self, rng, n):
        return "say a"


class Empty(Stringy):
    def train_examples(self, rng, n):
        return []


class Flat(Stringy):
    def train_examples(self, rng, n):
        return Undefined.train_examples(self, rng, n)

    def eval_examples(self, size):
        return [Example(id="q0", messages="say a", answer="a")]


register_task("undefined", Undefined)
register_task("stringy", Stringy)
register_task("empty", Empty)
register_task("flat", Flat)
'''


@pytest.mark.parametrize(("task", "message"), [
    ("undefined", "override task=undefined (over {SMOKE}): task: undefined (Undefined in bad_tasks.py): its "
                  "__init__'s annotations do not resolve"),
    ("stringy", "task Stringy in bad_tasks.py: train_examples returned str, expected a list of 64 Example"),
    ("empty", "task Empty in bad_tasks.py: train_examples returned an empty list, expected a list of 64 Example"),
    ("flat", "task Flat in bad_tasks.py: eval_examples returned Example 'q0' whose messages are 'say a', expected a "
             "list of {{role, content}} texts"),
])
def test_a_plugin_task_that_breaks_its_protocol_is_named_in_one_line(tmp_path, task, message):
    (tmp_path / "bad_tasks.py").write_text(BAD_TASKS)
    res = run("train", "--config", str(SMOKE), "--out", "run", "plugins=[bad_tasks.py]", f"task={task}", "steps=1",
              cwd=tmp_path)
    message = message.format(SMOKE=SMOKE)
    assert res.returncode == 2 and message in res.stderr and "Traceback" not in res.stderr, res.stderr[-2000:]

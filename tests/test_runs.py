"""Run folders and provenance (emapg.run.folder, through the CLI in-process): a run starts only in a new or
empty folder (or one of its own that never checkpointed), and a resume records what it changes and
refuses changes to the replay without --force."""

import json
from pathlib import Path

import pytest
import yaml

from emapg.cli import main

SMOKE = Path(__file__).resolve().parents[1] / "recipes" / "smoke.yaml"
FAST = ["steps=2", "export=false", "eval.size=0", "save_every=1"]


def train(*args):
    return main(["train", *args])


def test_a_folder_of_the_users_files_is_never_written_into(tmp_path, capsys):
    out = tmp_path / "mine"
    out.mkdir()
    (out / "config.yaml").write_text("my own notes\n")
    assert train("--config", str(SMOKE), "--out", str(out), *FAST) == 2
    err = capsys.readouterr().err
    assert "holds files emapg did not write (config.yaml)" in err and "Traceback" not in err
    assert sorted(p.name for p in out.iterdir()) == ["config.yaml"]
    assert (out / "config.yaml").read_text() == "my own notes\n"


def test_a_run_that_stopped_before_its_first_checkpoint_starts_again_in_its_folder(tmp_path, monkeypatch, capsys):
    import emapg.run.trainer as trainer_mod

    out = tmp_path / "run"

    from emapg.tasks.base import RewardError

    def boom(self, step):
        raise RewardError("the reward server went away")

    monkeypatch.setattr(trainer_mod.Trainer, "train_step", boom)
    assert train("--config", str(SMOKE), "--out", str(out), *FAST) == 2
    err = capsys.readouterr().err
    assert "the run failed at step 0; no checkpoint yet: run the same command again" in err
    assert "emapg: error: the reward server went away" in err

    def bug(self, step):  # a bug is not dressed as the user's mistake: its traceback shows, the hint too
        raise RuntimeError("expected scalar type Float but found BFloat16")

    monkeypatch.setattr(trainer_mod.Trainer, "train_step", bug)
    with pytest.raises(RuntimeError, match="expected scalar type"):
        train("--config", str(SMOKE), "--out", str(out), *FAST)
    assert "no checkpoint yet: run the same command again" in capsys.readouterr().err
    monkeypatch.undo()
    assert train("--config", str(SMOKE), "--out", str(out), *FAST) == 0
    assert "starting it again" in capsys.readouterr().err
    assert json.loads((out / "checkpoints" / "latest").read_text())["step"] == 2


def test_resume_records_its_changes_and_refuses_a_changed_replay_without_force(tmp_path, capsys):
    out = tmp_path / "run"
    # overrides may follow the options
    assert train("--config", str(SMOKE), "--out", str(out), "steps=2", "export=false", "eval.size=0") == 0
    config = (out / "config.yaml").read_text()
    assert train("--resume", str(out), "seed=1", "algo.eta=0.5", "steps=3") == 2
    err = capsys.readouterr().err
    assert "seed 0 -> 1" in err and "algo.eta 0.9 -> 0.5" in err and "--force" in err
    assert (out / "config.yaml").read_text() == config and not (out / "resumes.jsonl").exists()
    assert train("--resume", str(out), "steps=3") == 0  # longer: the replay of steps 1-2 is unchanged
    assert yaml.safe_load((out / "config.yaml").read_text())["steps"] == 3
    assert train("--resume", str(out), "--force", "algo.eta=0.5", "steps=4") == 0
    entries = [json.loads(line) for line in (out / "resumes.jsonl").read_text().splitlines()]
    assert [e["changed"] for e in entries] == [{"steps": [2, 3]}, {"algo.eta": [0.9, 0.5], "steps": [3, 4]}]
    assert [e["forced"] for e in entries] == [False, True]
    assert yaml.safe_load((out / "config.yaml").read_text())["algo"]["eta"] == 0.5


def test_evaluations_show_their_progress(tmp_path, capsys):
    from emapg.config import load_config
    from emapg.run.trainer import Trainer

    tr = Trainer(load_config(SMOKE, ["export=false", "eval.size=16"]), tmp_path, progress=True)
    tr.evaluate("anchor")
    assert "eval anchor at step 0 (16 problems)" in capsys.readouterr().err


def test_a_regular_install_runs_a_shipped_recipe_by_name_from_another_folder(tmp_path):
    """Build the wheel, install it (no editable link to the source tree) into a fresh virtual
    environment whose dependencies come from this one, and run `--config smoke` elsewhere."""
    import os
    import site
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[1]
    wheels = tmp_path / "wheels"
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w",
                    str(wheels), str(root)], check=True, capture_output=True)
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    vpy = venv / "bin" / "python"
    purelib = subprocess.run([str(vpy), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                             check=True, capture_output=True, text=True).stdout.strip()
    # the dependencies, as a plain path (this venv's .pth files, the editable emapg among them, are not read)
    Path(purelib, "deps.pth").write_text("\n".join(site.getsitepackages()) + "\n")
    subprocess.run([sys.executable, "-m", "pip", "--python", str(vpy), "install", "--no-deps", "-q",
                    str(next(wheels.glob("emapg-*.whl")))], check=True, capture_output=True)
    work = tmp_path / "elsewhere"
    work.mkdir()
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": ""}
    version = subprocess.run([str(vpy), "-m", "emapg", "--version"], cwd=work, env=env, capture_output=True, text=True)
    assert version.returncode == 0 and version.stdout.startswith("emapg 0."), version.stderr
    where = subprocess.run([str(vpy), "-c", "import emapg; print(emapg.__file__)"], cwd=work, env=env,
                           capture_output=True, text=True).stdout
    assert str(venv) in where and str(root) not in where  # the installed copy, not the source tree
    out = subprocess.run([str(vpy), "-m", "emapg", "train", "--config", "smoke", "--out", "run", "steps=1",
                          "eval.size=0", "export=false"], cwd=work, env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-2000:]
    assert (work / "run" / "checkpoints").is_dir()


def test_ctrl_c_stops_with_one_line_that_says_how_to_resume(tmp_path, monkeypatch, capsys):
    import emapg.run.trainer as trainer_mod

    out = tmp_path / "run"
    real = trainer_mod.Trainer.train_step

    def interrupted(self, step):
        if step == 2:
            raise KeyboardInterrupt
        return real(self, step)

    monkeypatch.setattr(trainer_mod.Trainer, "train_step", interrupted)
    assert train("--config", str(SMOKE), "--out", str(out), "steps=3", "save_every=1", "eval.size=0",
                 "export=false") == 130
    err = capsys.readouterr().err
    assert f"the run stopped at step 1; resume with: emapg train --resume {out}" in err and "Traceback" not in err


def test_a_folder_that_cannot_be_written_is_a_message(tmp_path, capsys):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    assert train("--config", str(SMOKE), "--out", str(blocker / "run"), *FAST) == 2
    err = capsys.readouterr().err
    assert "emapg: error:" in err and "Not a directory" in err and "Traceback" not in err


def _emapg(*args, **kw):
    import os
    import subprocess
    import sys

    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    return subprocess.Popen([sys.executable, "-m", "emapg", *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=env, **kw)


def _wait_for(path, seconds=120):
    import time

    end = time.monotonic() + seconds
    while not path.exists():
        assert time.monotonic() < end, f"{path} never appeared"
        time.sleep(0.2)


def test_a_run_folder_has_one_writer_and_a_killed_one_leaves_no_lock(tmp_path):
    """While `emapg train` writes a run, a second `train --out` and a `train --resume` of it are refused, naming
    the writer's PID, and change nothing; once the writer is SIGKILLed, a resume takes the folder and finishes."""
    import signal

    run = tmp_path / "run"
    first = _emapg("train", "--config", "smoke", "--out", str(run), "steps=400", "save_every=1", "eval.size=0",
                   "export=false")
    try:
        _wait_for(run / "checkpoints" / "latest")
        metrics = (run / "metrics.jsonl").read_text()
        for args in (["--config", "smoke", "--out", str(run)], ["--resume", str(run)]):
            second = _emapg("train", *args, "steps=2", "eval.size=0")
            _, err = second.communicate(timeout=120)
            assert second.returncode == 2, err
            assert f"another emapg process (PID {first.pid}) is writing this run folder" in err
            assert "Traceback" not in err
        assert (run / "metrics.jsonl").read_text().startswith(metrics)  # the writer's log, nothing interleaved
        assert not (run / "resumes.jsonl").exists()
    finally:
        first.send_signal(signal.SIGKILL)
        first.wait()
    debris = [run / ".config.yaml.tmp-999999", run / "checkpoints" / ".latest.tmp-999999"]  # a kill mid-write
    for path in debris:
        path.write_text("half")
    from emapg.run.checkpoint import resume_step

    third = _emapg("train", "--resume", str(run), f"steps={resume_step(run) + 1}")  # one step more
    _, err = third.communicate(timeout=300)
    assert third.returncode == 0, err
    assert "another emapg process" not in err
    assert not any(path.exists() for path in debris)  # the resume took the folder and swept them


def test_sigterm_stops_a_run_as_ctrl_c_does(tmp_path):
    """A scheduler's SIGTERM: the run stops with its resume hint and exit 143, and the resume works."""
    import signal

    run = tmp_path / "run"
    proc = _emapg("train", "--config", "smoke", "--out", str(run), "steps=400", "save_every=1", "eval.size=0",
                  "export=false")
    _wait_for(run / "checkpoints" / "latest")
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 143, err
    assert f"resume with: emapg train --resume {run}" in err and "terminated (SIGTERM)" in err
    assert "Traceback" not in err


def test_a_resume_to_a_step_it_has_reached_trains_nothing_and_says_so(tmp_path, capsys):
    out = tmp_path / "run"
    assert train("--config", str(SMOKE), "--out", str(out), "steps=2", "export=false", "eval.size=0") == 0
    capsys.readouterr()
    files = {p: p.stat().st_mtime_ns for p in out.rglob("*") if p.is_file() and p.name != ".emapg.lock"}
    assert train("--resume", str(out)) == 0
    assert "is at step 2 already (steps: 2): nothing to train" in capsys.readouterr().err
    assert train("--resume", str(out), "steps=1") == 2
    assert "steps: 1 is before step 2" in capsys.readouterr().err
    assert {p: p.stat().st_mtime_ns for p in files} == files  # nothing rewritten
    assert not (out / "resumes.jsonl").exists()


def _file_size_limit(limit):
    """A child's writes stop at ``limit`` bytes per file with EFBIG, as on a full disk (SIGXFSZ ignored)."""
    import resource
    import signal

    def limited():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, resource.RLIM_INFINITY))
    return limited


def test_a_full_disk_while_checkpointing_names_the_folder_and_loses_nothing(tmp_path):
    """A checkpoint write that runs out of room (safetensors' own error) ends in one line naming the
    checkpoint folder after the run's hint, leaves no half checkpoint, and the same command succeeds
    once there is room."""
    run = tmp_path / "run"
    cmd = ["train", "--config", "smoke", "--out", str(run), "steps=2", "save_every=1", "eval.size=0", "export=false"]
    proc = _emapg(*cmd, preexec_fn=_file_size_limit(400_000))  # the tiny policy's 430 kB file does not fit
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 2, err
    assert "Traceback" not in err and "SafetensorError" not in err
    assert f"emapg: error: {run / 'checkpoints' / 'step_000001'}: File too large" in err.splitlines()
    assert f"the run failed at step 1; no checkpoint yet: run the same command again to start over in {run}" in err
    assert not [p for p in (run / "checkpoints").iterdir()]  # no half-written checkpoint, no temporary folder
    again = _emapg(*cmd)
    _, err = again.communicate(timeout=300)
    assert again.returncode == 0, err
    assert json.loads((run / "checkpoints" / "latest").read_text())["step"] == 2


def test_a_full_disk_while_building_an_index_names_the_folder(tmp_path):
    """bm25s and numpy report a cut-short write without a path: the message names the index folder, and an
    index already there is untouched."""
    corpus = tmp_path / "corpus.jsonl"
    with open(corpus, "w") as f:
        for i in range(3000):
            text = f"passage {i} about topic {i % 97} and more words {i * 7}"
            f.write(json.dumps({"id": str(i), "text": text}) + "\n")
    proc = _emapg("index", "build", "--corpus", str(corpus), "--out", str(tmp_path / "ix"),
                  preexec_fn=_file_size_limit(50_000))
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 2, err
    assert "Traceback" not in err
    (line,) = [x for x in err.splitlines() if x.startswith("emapg: error:")]
    assert line.startswith(f"emapg: error: {tmp_path / 'ix'}: ") and ("File too large" in line or "cut short" in line)
    assert not [p for p in tmp_path.iterdir()  # the temporary folder is gone (the one-writer lock file stays)
                if p.name.startswith(".ix") and p.name != ".ix.emapg-lock"]


def _two_steps(tmp_path):
    out = tmp_path / "run"
    assert train("--config", str(SMOKE), "--out", str(out), *FAST) == 0
    return out


def test_files_read_back_are_checked_by_type_and_a_bad_one_falls_back_or_is_named(tmp_path, capsys):
    """state.json's keys are checked for their types (a string where a count is: the older checkpoint is
    used, not a TypeError mid-step); `latest` must name a step folder of this run (a number, or a path into
    another run, is damaged: the newest complete checkpoint is used); a backup folder beside the checkpoints
    blocks nothing."""
    import shutil

    out = _two_steps(tmp_path)
    ckpts = out / "checkpoints"
    shutil.copytree(ckpts / "step_000002", ckpts / "step_000002.bak")  # a user's backup
    state = json.loads((ckpts / "step_000002" / "state.json").read_text())
    (ckpts / "step_000002" / "state.json").write_text(json.dumps({**state, "skipped_steps": "abc"}))
    (ckpts / "latest").write_text(json.dumps({"checkpoint": 5}))
    capsys.readouterr()
    assert train("--resume", str(out), "steps=3") == 0
    err = capsys.readouterr().err
    assert "latest is damaged: it names 5, not a checkpoint folder of this run" in err
    assert "step_000002/state.json is damaged: skipped_steps is 'abc', expected a whole number >= 0" in err
    assert "resuming from" in err and "step_000001" in err and "Traceback" not in err
    assert json.loads((ckpts / "latest").read_text())["step"] == 3
    other = _two_steps(tmp_path / "other")
    (ckpts / "latest").write_text(json.dumps({"checkpoint": "../../other/run/checkpoints/step_000002"}))
    from emapg.run.checkpoint import CheckpointError, latest_checkpoint

    try:
        latest_checkpoint(out)
        raise AssertionError("a latest into another run was followed")
    except CheckpointError as e:
        assert "not a checkpoint folder of this run" in str(e)
    assert other.is_dir()


def test_a_metrics_file_is_read_line_by_line_and_a_cut_last_line_is_dropped(tmp_path, capsys):
    """A row that is not an object with a whole step is named with its file and line (was an AttributeError);
    a last line cut short by a kill is dropped with a warning and the resume goes on (was a JSON error naming
    no file)."""
    out = _two_steps(tmp_path)
    metrics = out / "metrics.jsonl"
    good = metrics.read_text()
    metrics.write_text(good + '{"step": 3, "reward_mean": 0.')  # killed mid-write
    capsys.readouterr()
    assert train("--resume", str(out), "steps=3") == 0
    err = capsys.readouterr().err
    assert "metrics.jsonl, line 3: cut short (a write was interrupted); dropped" in err
    assert [json.loads(line)["step"] for line in metrics.read_text().splitlines()] == [1, 2, 3]
    metrics.write_text(good.splitlines()[0] + "\n[1, 2]\n")
    assert train("--resume", str(out), "steps=4") == 2
    err = capsys.readouterr().err
    assert "metrics.jsonl, line 2: not a metrics row (a JSON list" in err and "Traceback" not in err
    assert metrics.read_text() == good.splitlines()[0] + "\n[1, 2]\n"  # nothing rewritten


def test_a_resume_that_cannot_start_changes_no_file(tmp_path, capsys):
    """Validate first, write after: a --force change whose model does not load, and a resume of a folder
    without a checkpoint, leave config.yaml and resumes.jsonl as they were."""
    out = _two_steps(tmp_path)
    config = (out / "config.yaml").read_text()
    capsys.readouterr()
    assert train("--resume", str(out), "--force", "model=/nonexistent/model", "steps=3") == 2
    assert "Traceback" not in capsys.readouterr().err
    assert (out / "config.yaml").read_text() == config and not (out / "resumes.jsonl").exists()
    import shutil

    shutil.rmtree(out / "checkpoints")
    assert train("--resume", str(out), "steps=3", "save_every=2") == 2
    assert (out / "config.yaml").read_text() == config and not (out / "resumes.jsonl").exists()


def test_a_resume_of_a_run_whose_end_was_cut_short_finishes_it(tmp_path, capsys, monkeypatch):
    """Killed after its last checkpoint but during its end (export, evaluation table, plots): the resume the
    message suggests finishes the end instead of saying "nothing to train"; once finished, it says so."""
    import emapg.run.trainer as trainer_mod

    def killed(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(trainer_mod, "export_models", killed)
    out = tmp_path / "run"
    assert train("--config", str(SMOKE), "--out", str(out), "steps=2", "eval.size=0", "save_every=1") == 130
    assert "resume with: emapg train --resume" in capsys.readouterr().err
    assert not (out / "eval.json").exists() and not (out / "finished.json").exists()
    monkeypatch.undo()
    assert train("--resume", str(out)) == 0
    assert "reached step 2, but its end (export, evaluation table, plots) did not finish: finishing it" in \
        capsys.readouterr().err
    assert (out / "eval.json").exists() and (out / "export" / "policy").is_dir()
    assert json.loads((out / "finished.json").read_text()) == {"step": 2}
    assert [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()] == [1, 2]
    assert train("--resume", str(out)) == 0
    assert "is at step 2 already (steps: 2): nothing to train" in capsys.readouterr().err


def _writers(run):
    """PIDs of live processes writing under ``run``'s lock through a launcher (EMAPG_RUN_LOCK names it)."""
    import os

    mine = f"EMAPG_RUN_LOCK={Path(run).resolve()}".encode()
    found = []
    for pid in (p for p in os.listdir("/proc") if p.isdigit()):
        try:
            environ = Path(f"/proc/{pid}/environ").read_bytes()
            state = Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0]
        except OSError:
            continue
        if mine in environ.split(b"\0") and state != "Z":
            found.append(int(pid))
    return found


def _gone(run, seconds=90):
    import time

    end = time.monotonic() + seconds
    while _writers(run):
        assert time.monotonic() < end, f"processes still writing {run}: {_writers(run)}"
        time.sleep(0.5)


def test_a_killed_launcher_takes_its_workers_with_it(tmp_path):
    """`train --nproc 2`: the launcher holds the folder's lock for its torchrun workers; SIGKILLed, it takes
    them with it (they ran on unlocked and a resume raced them), so the resume admitted next is the only
    writer and its metrics hold each step once."""
    import signal

    run = tmp_path / "run"
    first = _emapg("train", "--config", "smoke", "--out", str(run), "--nproc", "2", "steps=400", "save_every=1",
                   "eval.size=0", "export=false")
    try:
        _wait_for(run / "checkpoints" / "latest", seconds=300)
        assert _writers(run)  # the workers (and torchrun) run under the launcher's lock
    finally:
        first.send_signal(signal.SIGKILL)
        first.wait()
    _gone(run)
    from emapg.run.checkpoint import resume_step

    third = _emapg("train", "--resume", str(run), f"steps={resume_step(run) + 1}")
    _, err = third.communicate(timeout=300)
    assert third.returncode == 0, err
    steps = [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert steps == list(range(1, len(steps) + 1))


def test_a_worker_whose_launcher_ended_before_it_asked_ends(tmp_path):
    """The window before a torchrun worker's PR_SET_PDEATHSIG: a launcher SIGKILLed then leaves torchrun adopted
    (by init or a subreaper) and the request comes too late to fire, so the worker checks that the launcher is
    still its grandparent. Here the middle process (torchrun's place) is a shell: told the real grandparent
    (this test) the worker goes on; told another PID (a launcher that is gone) it ends by SIGTERM at once."""
    import os
    import subprocess
    import sys

    def worker(grandparent: int) -> subprocess.CompletedProcess:
        code = f"from emapg.run.folder import die_with_parent; die_with_parent({grandparent}); print('alive')"
        inner = subprocess.list2cmdline([sys.executable, "-c", code])
        return subprocess.run(["sh", "-c", f"{inner}; echo rc=$?"], capture_output=True, text=True, timeout=120)

    alive = worker(os.getpid())
    assert alive.stdout.split() == ["alive", "rc=0"], alive.stderr
    gone = worker(os.getpid() + 4_000_000)  # no process has this PID: the launcher ended
    assert gone.stdout.split() == [f"rc={128 + 15}"], gone.stderr  # SIGTERM, before anything else ran


def test_options_that_would_be_ignored_are_refused(tmp_path, capsys):
    """`--nproc 0` ran one process; `--out` and `--config` beside `--resume` were ignored silently; a config
    that is not UTF-8 named no file."""
    assert train("--config", str(SMOKE), "--out", str(tmp_path / "a"), "--nproc", "0") == 2
    assert "--nproc: must be >= 1, got 0" in capsys.readouterr().err
    assert train("--resume", str(tmp_path / "a"), "--out", str(tmp_path / "b"), "--config", str(SMOKE)) == 2
    assert "--out and --config: not with --resume, which continues" in capsys.readouterr().err
    bad = tmp_path / "bad.yaml"
    bad.write_bytes(b"model: tiny-llama\nsteps: \xff\n")
    assert train("--config", str(bad), "--out", str(tmp_path / "c")) == 2
    assert "bad.yaml, line 2: not UTF-8 text (byte 0xff)" in capsys.readouterr().err
    assert not any((tmp_path / n).exists() for n in "abc")


def test_a_full_disk_while_logging_names_the_file(tmp_path):
    """metrics.jsonl (or outcomes, resumes, an atomic JSON) that cannot grow: one line naming the file, not a bare
    "File too large" / "No space left on device"."""
    run = tmp_path / "run"
    cmd = ["train", "--config", "smoke", "--out", str(run), "steps=40", "save_every=0", "export=false",
           "eval.size=0", "report_to=[]"]
    proc = _emapg(*cmd, preexec_fn=_file_size_limit(8_000))
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 2, err
    assert f"emapg: error: {run / 'metrics.jsonl'}: File too large" in err.splitlines(), err[-2000:]
    assert "Traceback" not in err


def test_a_full_disk_under_tensorboard_names_its_folder_and_keeps_the_row(tmp_path, monkeypatch):
    """TensorBoard's writer thread meets a full disk and raises a bare OSError ("No space left on device", no file)
    at the next write: the error names the run's tensorboard folder, and the step's metrics.jsonl row is kept."""
    import errno

    from emapg.run.metrics import MetricsWriter

    writer = MetricsWriter(tmp_path)

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(writer.tb, "flush", full)
    with pytest.raises(OSError) as e:
        writer.write({"step": 1, "reward_mean": 0.5})
    assert str(e.value) == f"[Errno 28] No space left on device: '{tmp_path / 'tensorboard'}'"
    assert json.loads((tmp_path / "metrics.jsonl").read_text()) == {"step": 1, "reward_mean": 0.5}
    monkeypatch.setattr(writer.tb, "close", full)
    with pytest.raises(OSError, match="tensorboard"):
        writer.close()

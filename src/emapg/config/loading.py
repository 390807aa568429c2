"""Reading a config: YAML files (with ``extends:``), dotted ``KEY=VALUE`` overrides, plugins, and the typed
reading of a mapping into the schema's dataclasses that every file kind of emapg's uses.

``load_config(path, overrides)`` reads a YAML file, applies overrides (``algo.k=16``) and validates it
(:mod:`emapg.config.rules`); every error names the field, the file (and line, for YAML syntax) or the override
that set it, and what was expected, all problems in one message. :func:`typed` is the reader: a mapping into a
dataclass, every field's type checked and every problem collected (a study's spec is read with it too).
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib
import re
import sys
from pathlib import Path
from typing import Any, get_type_hints

import yaml

from emapg.atomic import write_text_atomic
from emapg.config.rules import TaskCheck, args_problems, validate
from emapg.config.schema import RolloutConfig, TrainConfig
from emapg.errors import ConfigError, not_utf8, regular_file
from emapg.settings import all_of, moved_hint, typed

SHIPPED_RECIPES = Path(__file__).resolve().parent.parent / "recipes"


MOVED = {"rollout": {f"vllm_{k}": f"rollout.backend_args.{k}" for k in
                    ("gpu_memory", "max_model_len", "kv_cache_gib", "sleep", "seeds", "enforce_eager")}}
"""Keys an earlier emapg had, by section, and where they are now (named in the unknown-key message)."""


def _migrated(data: dict[str, Any]) -> dict[str, Any]:
    """A config file written by an earlier emapg (a run folder's config.yaml, a study's records): its moved keys
    read where they are now (:data:`MOVED`). The vllm_* settings go into ``rollout.backend_args`` where the
    backend is vllm (a value the file also sets there wins) and are dropped elsewhere (they did nothing there)."""
    rollout = data.get("rollout")
    if not isinstance(rollout, dict) or not set(rollout) & set(MOVED["rollout"]):
        return data
    old = {MOVED["rollout"][k].rsplit(".", 1)[1]: rollout[k] for k in MOVED["rollout"] if k in rollout}
    rollout = {k: v for k, v in rollout.items() if k not in MOVED["rollout"]}
    if rollout.get("backend") == "vllm":
        given = rollout.get("backend_args")
        rollout["backend_args"] = {**old, **(given if isinstance(given, dict) else {})}
    return {**data, "rollout": rollout}


def _moved(where: str, keys: set[str]) -> str:
    return moved_hint(MOVED, where, keys)


# task_args keys of which a task takes one (search_qa's retriever: an index folder, a server, or the generated
# knowledge base): an override naming one drops the others the config file set.
ONE_OF_TASK_ARGS = (frozenset({"index", "retriever_url", "synthetic"}),)


def merged_task_args(base: dict[str, Any], new: dict[str, Any]) -> dict[str, Any]:
    """``base`` updated with ``new``, where a key of :data:`ONE_OF_TASK_ARGS` set in ``new`` (not null) drops the
    other keys of its group from ``base`` (the retriever named last replaces the earlier one)."""
    out = dict(base)
    for group in ONE_OF_TASK_ARGS:
        if any(new.get(k) is not None for k in group):
            for other in group - set(new):
                out.pop(other, None)
    out.update(new)
    return out


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> list[str]:
    """Apply ``overrides`` in order; return the messages of those that cannot apply (an unknown key), reported with
    every other problem. An override that changes ``rollout.backend`` drops the ``rollout.backend_args`` the
    config gave the previous backend, keeping those the overrides give (in any order)."""
    rollout = data.get("rollout") if isinstance(data.get("rollout"), dict) else {}
    backend, given = rollout.get("backend", RolloutConfig.backend), rollout.get("backend_args")
    unapplied = []
    for item in overrides:
        try:
            apply_override(data, item)
        except ConfigError as e:
            unapplied.append(str(e))
    rollout = data.get("rollout")
    if isinstance(rollout, dict) and rollout.get("backend", backend) != backend and isinstance(given, dict):
        named = [item.split("=", 1)[0].strip() for item in overrides]
        if "rollout.backend_args" not in named:
            mine = {k for k in given if f"rollout.backend_args.{k}" in named}
            rollout["backend_args"] = {k: v for k, v in (rollout.get("backend_args") or {}).items()
                                       if k not in given or k in mine}
    return unapplied


def apply_override(data: dict[str, Any], item: str) -> None:
    """Apply one ``a.b.c=value`` override in place; the value is parsed as YAML (so 0.9, true, null). A
    task_args key of :data:`ONE_OF_TASK_ARGS` drops the other keys of its group."""
    if "=" not in item:
        raise ConfigError(f"override {item!r}: expected KEY=VALUE, e.g. algo.eta=0.95")
    key, raw = item.split("=", 1)
    try:
        value = load_yaml(raw) if raw.strip() else ""  # as a config file's values are read (012 stays text)
    except yaml.YAMLError as e:
        raise ConfigError(f"override {item!r}: its value is not YAML ({str(e).splitlines()[0]})") from None
    parts = key.strip().split(".")
    cls, node = TrainConfig, data
    for i, part in enumerate(parts):
        hints = get_type_hints(cls)
        if part not in hints:
            prefix = ".".join(parts[:i]) or "top level"
            raise ConfigError(f"override {key!r}: unknown key {part!r} in {prefix}; known: {', '.join(hints)}"
                              + _moved(".".join(parts[:i]), {part}))
        if i == len(parts) - 1:
            node[part] = value
        elif dataclasses.is_dataclass(hints[part]):
            node = node.setdefault(part, {})
            cls = hints[part]
        elif "dict" in str(hints[part]):  # free-form mapping (task_args.digits=3)
            node = node.setdefault(part, {})
            entry = {".".join(parts[i + 1 :]): value}
            merged = merged_task_args(node, entry) if part == "task_args" else {**node, **entry}
            node.clear()
            node.update(merged)
            return
        else:
            raise ConfigError(f"override {key!r}: {part!r} is not a section")


class _UniqueKeys(yaml.SafeLoader):
    """PyYAML's safe loader, refusing a mapping that gives a key twice (YAML keeps the last silently) or a key
    that is not text (a number, a list)."""


def _unique_mapping(loader: _UniqueKeys, node: yaml.MappingNode, deep: bool = False):
    seen: dict[str, int] = {}
    for key_node, _ in node.value:
        line = key_node.start_mark.line + 1
        if key_node.tag == "tag:yaml.org,2002:merge":  # PyYAML's own message named only a tag
            raise yaml.constructor.ConstructorError(None, None, "a YAML merge key (<<) is not "
                                                    "supported here: write the keys out, or use extends: for a "
                                                    "config that builds on another", key_node.start_mark)
        key = loader.construct_object(key_node, deep=deep)
        if not isinstance(key, str):  # a config's or spec's keys are names (1: a gave a TypeError far away)
            raise yaml.constructor.ConstructorError(None, None, f"key {key!r} on line {line} is not a name (keys "
                                                    "are text: quote it if you meant it)", key_node.start_mark)
        if key in seen:
            raise yaml.constructor.ConstructorError(None, None, f"key {key!r} is given twice, on line {seen[key]} and "
                                                    f"line {line} (YAML would keep the last silently)",
                                                    key_node.start_mark)
        seen[key] = line
    return loader.construct_mapping(node, deep=deep)


_UniqueKeys.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _unique_mapping)
# YAML 1.1's numbers without its octal (012 read as 10) and base-60 (1:30 read as 90) forms: such a value stays
# text, which the field's type then refuses by name, instead of a seed silently changed
_NUMBERS = {"tag:yaml.org,2002:int", "tag:yaml.org,2002:float"}
_UniqueKeys.yaml_implicit_resolvers = {first: [(tag, rx) for tag, rx in resolvers if tag not in _NUMBERS]
                                       for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()}
_UniqueKeys.add_implicit_resolver("tag:yaml.org,2002:int", re.compile(
    r"^(?:[-+]?0b[0-1_]+|[-+]?(?:0|[1-9][0-9_]*)|[-+]?0x[0-9a-fA-F_]+)$"), list("-+0123456789"))
_UniqueKeys.add_implicit_resolver("tag:yaml.org,2002:float", re.compile(
    r"^(?:[-+]?(?:[0-9][0-9_]*)\.[0-9_]*(?:[eE][-+][0-9]+)?|\.[0-9][0-9_]*(?:[eE][-+][0-9]+)?"
    r"|[-+]?\.(?:inf|Inf|INF)|\.(?:nan|NaN|NAN))$"), list("-+0123456789."))


def load_yaml(text: str) -> Any:
    """A YAML document, safely (no object is built from a tag), with each mapping's keys given once."""
    return yaml.load(text, Loader=_UniqueKeys)  # noqa: S506 - a SafeLoader subclass


TRUST_FLAG = "--trust-plugins"
RUN_MARKER = ".emapg-run"
"""The file emapg writes at the top of every run folder (:mod:`emapg.run.folder`)."""


COMPARE_MARKER = ".compare.lock"
"""The file ``emapg compare`` writes at the top of its ``--out``, the folder it writes runs into."""


def run_folder_of(path: str | Path, *, or_compare: bool = False) -> Path | None:
    """The run folder that holds ``path`` (the nearest folder above it with :data:`RUN_MARKER`), or None;
    ``or_compare``: a compare's ``--out`` (:data:`COMPARE_MARKER`) counts too."""
    for folder in Path(path).resolve().parents:
        if (folder / RUN_MARKER).exists() or (or_compare and (folder / COMPARE_MARKER).exists()):
            return folder
    return None


def load_config(path: str | Path | None = None, overrides: list[str] | None = None,
                trust_plugins: bool = False, task_check: TaskCheck | None = None, of_run: bool = False) -> TrainConfig:
    """Read a YAML config (or the defaults), apply overrides, validate, and return it. ``task_check``
    (:func:`emapg.tasks.task_args_problems`, which every command passes) checks ``task_args`` with the other
    fields, in the same one message, before any model loads; without it they are checked when the task is built.

    A config's ``plugins`` are code, and one rule decides whether they are imported, on every path that reads a
    config (train, resume, plan, eval, export, compare): plugins named by a file the user wrote are; plugins named
    by a config inside a run folder (its own config.yaml, or any file in a folder emapg wrote a run into, a
    compare's ``--out`` included, which another person or job may have written), or by a file extending one, are
    not unless the user passes
    ``--trust-plugins`` on this command line (``trust_plugins``): refused, naming them and the folder. ``of_run``:
    ``path`` is a run's own config.yaml (a resume, ``eval --run``, an export), under that rule whether or not its
    folder still holds emapg's marker (a copy without its hidden files)."""
    data: dict[str, Any] = {}
    source = "defaults"
    read: list[Path] = []  # the files read: this one and the ones it extends
    origins: dict[str, Path] = {}  # each dotted key, the file that set it
    if path is not None:
        source = str(path)
        regular_file(path, "config file")
        try:
            text = Path(path).read_bytes().decode("utf-8")
        except OSError as e:
            raise ConfigError(f"config file {path}: {e.strerror}") from e
        except UnicodeDecodeError as e:
            raise ConfigError(f"config file {path}, {not_utf8(e)}") from None
        try:
            data = load_yaml(text)
        except yaml.YAMLError as e:
            mark = getattr(e, "problem_mark", None)
            line = f", line {mark.line + 1}" if mark is not None else ""
            raise ConfigError(f"config file {path}{line}: invalid YAML: {getattr(e, 'problem', e)}") from e
        if data is None and of_run:  # a run's config.yaml emptied: --config advice would not apply
            raise ConfigError(f"config file {path}: the run's config is empty (it holds no settings); restore it "
                              "from a copy of the run, or start a new run (nothing was changed)")
        if data is None:
            raise ConfigError(f"config file {path}: the file is empty (give at least one key, e.g. model: ..., "
                              "or leave --config out for the defaults)")
        if not isinstance(data, dict):
            raise ConfigError(f"config file {path}: expected a mapping at the top level")
        _origins({k: v for k, v in data.items() if k != "extends"}, Path(path), origins)
        data = _migrated(_extended(data, Path(path), seen=(Path(path).resolve(),), read=read, origins=origins))
    unapplied = apply_overrides(data, overrides or [])
    foreign = next((f for f in (*map(Path, [path] if path is not None else []), *read)
                    if run_folder_of(f, or_compare=True)), None)
    if of_run and path is not None:  # a run's own config.yaml (--resume, eval --run, export), marker or not
        foreign = foreign or Path(path)
    if not trust_plugins and data.get("plugins") and foreign is not None:
        named = data["plugins"] if isinstance(data["plugins"], list) else [data["plugins"]]
        raise ConfigError(f"config file {source}: it names plugins ({', '.join(map(str, named))}), which are code "
                          f"run on import, from {foreign}, inside the run folder "
                          f"{run_folder_of(foreign, or_compare=True) or Path(foreign).parent}: a config "
                          f"from a run folder imports none unless you pass {TRUST_FLAG} (read them first)")
    try:
        import_plugins(data.get("plugins") or [])
        try:
            cfg = typed(TrainConfig, data, "", MOVED)  # every field's type and own rule: all problems at once
        except ConfigError as e:  # and task_args and backend_args, checked on what was read, in the same message
            raise all_of(e.problems + (args_problems(e.partial, task_check) if e.partial is not None else [])) from None
        validate(cfg, task_check)
    except ConfigError as e:  # each problem blamed on where its value came from: the file or an override
        blames = [_blamed(p, source, overrides or [], origins) for p in e.problems]
        trees = {b: _key_tree(b) for b in set(blames)}  # each blamed file parsed once, for its keys' lines
        lines = [_line_in(trees[b], p) for b, p in zip(blames, e.problems, strict=True)]
        at = [f"line {n}: {p}" if n else p for p, n in zip(e.problems, lines, strict=True)]
        if len(set(blames)) == 1 and not unapplied:  # one place to fix: named once
            if len(at) == 1 and lines[0]:
                raise ConfigError(f"{blames[0]}, {at[0]}", [f"{blames[0]}, {at[0]}"]) from None
            head = f"{blames[0]}: " + (f"{len(blames)} problems: " if len(blames) > 1 else "")
            raise ConfigError(head + "; ".join(at), [f"{blames[0]}: {a}" for a in at]) from None
        raise all_of(unapplied + [f"{b}, {a}" if n else f"{b}: {a}"
                                  for b, a, n in zip(blames, at, lines, strict=True)]) from None
    if unapplied:
        raise all_of(unapplied)
    return cfg


def import_plugins(names: Any) -> None:
    """Import a config's ``plugins`` (module names or ``.py`` files), each once per process; ConfigError naming
    the plugin when one is not found or fails to import."""
    if not isinstance(names, list) or not all(isinstance(n, str) and n.strip() for n in names):
        raise ConfigError(f"plugins: expected a list of module names or .py files, got {names!r}")
    for name in names:
        try:
            if name.endswith(".py"):
                path = Path(name).resolve()
                key = f"emapg_plugin_{hashlib.sha256(str(path).encode()).hexdigest()[:12]}_{path.stem}"
                if key in sys.modules or _imported_from(path):  # once, by file or as a module
                    continue
                if not path.is_file():
                    raise ConfigError(f"plugins: {name}: no such file (relative to {Path.cwd()})")
                spec = importlib.util.spec_from_file_location(key, path)
                module = importlib.util.module_from_spec(spec)
                sys.modules[key] = module
                try:
                    spec.loader.exec_module(module)
                except BaseException:
                    del sys.modules[key]
                    raise
            else:
                if str(Path.cwd()) not in sys.path and "" not in sys.path:
                    sys.path.append(str(Path.cwd()))  # as `python -m` finds a module in the working directory
                spec = importlib.util.find_spec(name)
                if spec is not None and spec.origin and name not in sys.modules and _imported_from(Path(spec.origin)):
                    continue  # the same file was imported as a .py plugin already
                importlib.import_module(name)
        except ConfigError:
            raise
        except SystemExit as e:  # a plugin's own sys.exit or argparse error: not emapg's exit
            raise ConfigError(f"plugins: importing {name} exited (SystemExit {e.code!r}): a plugin must not exit or "
                              "parse the command line on import") from None
        except ModuleNotFoundError as e:
            raise ConfigError(f"plugins: {name}: {e}") from None
        except Exception as e:  # the plugin's own error, named in one line
            raise ConfigError(f"plugins: importing {name} failed: {type(e).__name__}: {e}") from None


def _imported_from(path: Path) -> bool:
    """Whether a module imported already was loaded from ``path`` (a plugin named once as a module and once as
    its file is the same plugin: importing it twice would register its names twice)."""
    target = path.resolve()
    for module in list(sys.modules.values()):
        origin = getattr(module, "__file__", None)
        if origin and origin.endswith(".py") and Path(origin).resolve() == target:
            return True
    return False


def _blamed(message: str, source: str, overrides: list[str], origins: dict[str, Path] | None = None) -> str:
    """Where a bad value came from: the command line's ``KEY=VALUE`` that set the field the message names
    (``override steps=abc (over smoke.yaml)``), else the file that set it (``origins``: a file it extends, when the
    value is that file's), else the config file."""
    field = _field_of(message)
    for item in reversed(overrides):  # the last override of a field is the one that counts
        key = item.split("=", 1)[0].strip()
        if key == field or key.startswith(field + ".") or field.startswith(key + "."):
            return f"override {item} (over {source})"
    parts = field.split(".")
    for n in range(len(parts), 0, -1):  # the field, or the section that set it whole
        if ".".join(parts[:n]) in (origins or {}):
            return str(origins[".".join(parts[:n])])
    return source


def _field_of(problem: str) -> str:
    """The dotted field a problem names: its own (``algo.eta: must be...``), or a section's first unknown key
    (``algo: unknown key(s) etta`` names ``algo.etta``, which an override of ``algo.beta`` did not set)."""
    unknown = re.match(r"^(.*?): unknown key\(s\) ([^;,\s]+)", problem)
    if unknown:
        return unknown[2] if unknown[1] == "top level" else f"{unknown[1]}.{unknown[2]}"
    return problem.split(":", 1)[0].strip()


def _key_tree(blame: str) -> yaml.Node | None:
    """The YAML tree of the file ``blame`` names, with its keys' lines; None for an override's or the defaults'
    blame, or a file that no longer reads."""
    if blame.startswith("override ") or blame == "defaults":
        return None
    try:
        return yaml.compose(Path(blame).read_bytes().decode("utf-8"), Loader=_UniqueKeys)
    except (OSError, UnicodeDecodeError, yaml.YAMLError):
        return None


def _line_in(node: yaml.Node | None, problem: str) -> int | None:
    """The line that holds the key ``problem`` names in a file's tree (:func:`_key_tree`): the field's own key,
    the first unknown key of a section, or the deepest of the field's sections the file gives."""
    line = None
    for part in _field_of(problem).split("."):
        pairs = node.value if isinstance(node, yaml.MappingNode) else []
        key = next(((k, v) for k, v in pairs if getattr(k, "value", None) == part), None)
        if key is None:
            break
        line, node = key[0].start_mark.line + 1, key[1]
    return line


def _origins(data: dict[str, Any], path: Path, out: dict[str, Path], prefix: str = "") -> None:
    """Each dotted key ``data`` (one file's own mapping) sets, as set by ``path``."""
    for key, value in data.items():
        out[f"{prefix}{key}"] = path
        if isinstance(value, dict):
            _origins(value, path, out, f"{prefix}{key}.")


def _merge(base: dict[str, Any], top: dict[str, Any]) -> dict[str, Any]:
    """``top`` over ``base``, section by section (a mapping in both is merged; anything else replaced)."""
    out = dict(base)
    for key, value in top.items():
        out[key] = _merge(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


def _extended(data: dict[str, Any], path: Path, seen: tuple[Path, ...], read: list[Path] | None = None,
              origins: dict[str, Path] | None = None) -> dict[str, Any]:
    """A config with ``extends: OTHER`` (a file beside it, or a shipped recipe's name): OTHER's keys, then
    this file's over them, so a recipe's variant states only what differs. A file that sets another task than
    OTHER's takes none of OTHER's ``task_args`` (they are that task's). ``read`` collects the files extended."""
    if "extends" not in data:
        return data
    name = data.pop("extends")
    if not isinstance(name, str) or not name.strip():
        raise ConfigError(f"config file {path}: extends: expected the name or file of another config, got {name!r}")
    file = name if name.endswith(".yaml") else f"{name}.yaml"
    base = path.parent / file
    if not base.exists() and (SHIPPED_RECIPES / file).exists():  # a shipped recipe's name
        base = SHIPPED_RECIPES / file
    if base.resolve() in seen:
        raise ConfigError(f"config file {path}: extends: {name} extends this file again (a cycle)")
    regular_file(base, f"config file {path}: extends:")
    try:
        parent = load_yaml(base.read_bytes().decode("utf-8"))
    except UnicodeDecodeError as e:
        raise ConfigError(f"config file {path}: extends: {base}, {not_utf8(e)}") from None
    except OSError as e:
        raise ConfigError(f"config file {path}: extends: {base}: {e.strerror}") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"config file {path}: extends: {base}: invalid YAML: {getattr(e, 'problem', e)}") from None
    if not isinstance(parent, dict):
        raise ConfigError(f"config file {base}: expected a mapping at the top level")
    if read is not None:
        read.append(base)
    winners, own = dict(origins or {}), {}  # the keys of the files extending OTHER win over OTHER's own
    _origins({k: v for k, v in parent.items() if k != "extends"}, base, own)
    parent = _extended(parent, base, (*seen, base.resolve()), read, origins)  # (its own parents' keys)
    if origins is not None:
        origins.update(own)
        origins.update(winners)
    if "task" in data and data["task"] != parent.get("task"):  # another task: the parent's task_args are not its
        parent = {k: v for k, v in parent.items() if k != "task_args"}
    mine, theirs = data.get("rollout"), parent.get("rollout")
    if isinstance(mine, dict) and isinstance(theirs, dict) and mine.get("backend", theirs.get("backend")) != \
            theirs.get("backend"):  # another backend: the parent's backend_args are not its
        parent = {**parent, "rollout": {k: v for k, v in theirs.items() if k != "backend_args"}}
    return _merge(parent, data)


def to_dict(cfg: TrainConfig) -> dict[str, Any]:
    """Plain-data form for config.yaml in the run folder."""
    return dataclasses.asdict(cfg)


def save_config(cfg: TrainConfig, path: str | Path) -> None:
    """config.yaml of a run folder, written atomically."""
    write_text_atomic(Path(path), yaml.safe_dump(to_dict(cfg), sort_keys=False))

"""Tasks, by name: the built-in ones and any a user's module registers (:func:`register_task`)."""

from __future__ import annotations

import inspect
import typing
from typing import Any

from emapg.errors import ConfigError
from emapg.settings import rule_problems
from emapg.tasks.arithmetic import ArithmeticTask
from emapg.tasks.base import Example, Task, defined_in
from emapg.tasks.math import MathTask
from emapg.tasks.search_qa import SearchQATask

TASKS: dict[str, type[Task]] = {"arithmetic": ArithmeticTask, "math": MathTask, "search_qa": SearchQATask}
"""Every task, by name; the config's ``task`` and ``emapg eval --task`` take these."""


def register_task(name: str, cls: type[Task]) -> type[Task]:
    """Add a task from your own module (list the module in a config's ``plugins``): a subclass of
    :class:`~emapg.tasks.base.Task` whose keyword arguments are the config's ``task_args``."""
    if name in TASKS:
        raise ValueError(f"a task named {name!r} exists already")
    if not (isinstance(cls, type) and issubclass(cls, Task)):
        raise TypeError(f"register_task({name!r}, ...): expected a subclass of emapg.tasks.base.Task, got {cls!r}")
    TASKS[name] = cls
    return cls


_SIMPLE = {int: "an integer", float: "a number", str: "a string", bool: "true or false"}


def task_args_problems(name: str, kwargs: dict[str, Any]) -> list[str]:
    """Every wrong entry of task ``name``'s ``task_args``: an unknown key (the known ones listed), a value of
    the wrong type where the task's signature declares int, float, str or bool, and a value its ``ARGS``
    rules refuse (checked like the config's own fields). An unknown task: none here (the config's ``task``
    field says so; :func:`make_task` refuses it). ``load_config(..., task_check=task_args_problems)`` checks a
    config's ``task_args`` with its other fields, before any model loads."""
    if name not in TASKS:
        return []
    cls = TASKS[name]
    params = inspect.signature(cls.__init__).parameters
    open_ended = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())  # **kwargs takes any key
    known = [p for p, v in params.items() if p != "self" and v.kind not in (v.VAR_KEYWORD, v.VAR_POSITIONAL)]
    try:
        hints = typing.get_type_hints(cls.__init__)
    except Exception as e:  # a plugin's annotation naming a type its module does not define
        raise ConfigError(f"task: {name} ({defined_in(cls)}): its __init__'s annotations do not "
                          f"resolve ({type(e).__name__}: {e})") from None
    problems, typed = [], {}
    for key, value in kwargs.items():
        if key not in known and not open_ended:
            problems.append(f"task_args.{key}: unknown for the {name} task; it takes {', '.join(known)}")
            continue
        want = hints.get(key)
        if want in _SIMPLE and value is not None:
            ok = isinstance(value, want) and (want is bool or not isinstance(value, bool))
            ok = ok or (want is float and isinstance(value, int) and not isinstance(value, bool))
            if not ok:
                problems.append(f"task_args.{key}: expected {_SIMPLE[want]}, got {value!r}")
                continue
        if key in cls.ARGS:
            typed[key] = value
    return problems + rule_problems(cls.ARGS, typed, prefix="task_args.")


def make_task(name: str, **kwargs: Any) -> Task:
    """Build a task by name with its ``task_args``, checked first (every wrong entry in one message naming it)."""
    if name not in TASKS:
        raise ConfigError(f"task: unknown task {name!r}; available: {', '.join(TASKS)}")
    problems = task_args_problems(name, kwargs)
    if problems:
        raise ConfigError("; ".join(problems), problems)
    try:
        return TASKS[name](**kwargs)
    except TypeError as e:  # a task taking **kwargs passes them on, to a class that refuses one by name
        if "unexpected keyword argument" not in str(e):
            raise
        key = str(e).rsplit("argument", 1)[-1].strip(" '\"")
        raise ConfigError(f"task_args.{key}: task {name} does not take it ({e})") from None


__all__ = ["Example", "Task", "TASKS", "make_task", "register_task", "task_args_problems"]

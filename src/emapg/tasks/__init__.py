"""Built-in tasks, by name."""

from __future__ import annotations

import typing
from typing import Any

from emapg.tasks.arithmetic import ArithmeticTask
from emapg.tasks.base import Example, Task
from emapg.tasks.math import MathTask
from emapg.tasks.search_qa import SearchQATask

TASKS = {"arithmetic": ArithmeticTask, "math": MathTask, "search_qa": SearchQATask}


_SIMPLE = {int: "an integer", float: "a number", str: "a string", bool: "true or false"}


def _check_types(cls: type, kwargs: dict[str, Any]) -> None:
    """task_args whose declared type is int, float, str or bool must have it (digits=two names the field)."""
    hints = typing.get_type_hints(cls.__init__)
    for key, value in kwargs.items():
        want = hints.get(key)
        if want not in _SIMPLE:
            continue
        ok = isinstance(value, want) and (want is bool or not isinstance(value, bool))
        if want is float and isinstance(value, int) and not isinstance(value, bool):
            ok = True
        if not ok:
            raise ValueError(f"task_args.{key}: expected {_SIMPLE[want]}, got {value!r}")


def make_task(name: str, **kwargs: Any) -> Task:
    """Build a task by name with its ``task_args``; raise naming the bad field."""
    if name not in TASKS:
        raise ValueError(f"task: unknown task {name!r}; available: {', '.join(TASKS)}")
    _check_types(TASKS[name], kwargs)
    try:
        return TASKS[name](**kwargs)
    except TypeError as e:
        raise ValueError(f"task_args for {name!r}: {e}") from e


__all__ = ["Example", "Task", "TASKS", "make_task"]

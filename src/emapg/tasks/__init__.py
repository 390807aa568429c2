"""Built-in tasks, by name."""

from __future__ import annotations

from typing import Any

from emapg.tasks.arithmetic import ArithmeticTask
from emapg.tasks.base import Example, Task
from emapg.tasks.math import MathTask
from emapg.tasks.search_qa import SearchQATask

TASKS = {"arithmetic": ArithmeticTask, "math": MathTask, "search_qa": SearchQATask}


def make_task(name: str, **kwargs: Any) -> Task:
    """Build a task by name with its ``task_args``; raise naming the bad field."""
    if name not in TASKS:
        raise ValueError(f"task: unknown task {name!r}; available: {', '.join(TASKS)}")
    try:
        return TASKS[name](**kwargs)
    except TypeError as e:
        raise ValueError(f"task_args for {name!r}: {e}") from e


__all__ = ["Example", "Task", "TASKS", "make_task"]

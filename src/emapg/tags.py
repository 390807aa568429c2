"""The Search-R1 text protocol (docs/METHOD.md section 6), shared by the episode loop and the search task.

The model writes ``<search> query </search>`` and ends with ``<answer> ... </answer>``; the
environment answers a search with ``<information> ... </information>``.
"""

from __future__ import annotations

import re

SEARCH_RE = re.compile(r"<search>(.*?)</search>", re.S)
ANSWER_RE = re.compile(r"<answer>(.*?)</answer>", re.S)
INFO_RE = re.compile(r"<information>.*?(</information>|$)", re.S)
TAG_RE = re.compile(r"</?(search|answer|information|think)>")
STOPS = ["</search>", "</answer>"]
"""The strings that end a model turn."""
INVALID_ACTION = ("\nMy previous action is invalid. If I want to search, I should put the query between <search> and "
                  "</search>. If I want to give the final answer, I should put the answer between <answer> and "
                  "</answer>. Let me try again.\n")
"""Search-R1's observation after a turn with neither a search nor an answer, byte for byte (its generation.py
``execute_predictions``): the episode goes on."""


def format_information(passages) -> str:
    """Search-R1's observation text, byte for byte (its generation.py ``_passages2string`` and
    ``execute_predictions``): each passage's ``contents`` split at its first newline into the title line (kept
    as written, quotes and all) and the text, ``Doc i(Title: TITLE) TEXT`` joined by newlines, stripped, in
    ``\n\n<information>...</information>\n\n``. One function for every retriever, local or served, so that
    both paths give the same tokens. Ours alone: tags inside a passage are removed, so that a document cannot
    end or answer an episode on the model's behalf (Wikipedia passages hold none)."""
    docs = ""
    for i, p in enumerate(passages):
        title, _, text = p.contents.partition("\n")
        docs += f"Doc {i + 1}(Title: {TAG_RE.sub('', title)}) {TAG_RE.sub('', text)}\n"
    return f"\n\n<information>{docs.strip()}</information>\n\n"


def model_text(completion: str) -> str:
    """The model's own text of a response: the information blocks and the invalid-action replies removed (the
    latter quote ``<answer> and </answer>``, which is not the model's answer)."""
    return INFO_RE.sub(" ", completion).replace(INVALID_ACTION.strip(), " ")


def answers_in(text: str) -> list[str]:
    """What ``ANSWER_RE.findall(text)`` finds (each leftmost ``<answer>`` to the next ``</answer>``), in time linear
    in the text: the regular expression rescans to the end from every unclosed ``<answer>`` (9,000 of them in
    72,000 characters took seconds)."""
    found, pos = [], 0
    while (start := text.find("<answer>", pos)) >= 0:
        end = text.find("</answer>", start + 8)
        if end < 0:
            break
        found.append(text[start + 8 : end])
        pos = end + 9
    return found


def extract_answer(completion: str) -> str | None:
    """The content of the last <answer>...</answer> the model wrote, or None."""
    found = answers_in(model_text(completion))
    return found[-1].strip() if found else None

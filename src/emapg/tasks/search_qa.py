"""Question answering with a search engine (the Search-R1 protocol): multi-turn episodes over a
retriever, reward = exact match (or F1) of the final <answer> against the gold answers.

Data: ``{id, question, answers}`` rows (NQ, TriviaQA, PopQA, HotpotQA, 2WikiMultiHopQA, Musique,
Bamboogle in the FlashRAG/Search-R1 format); ``answers`` may be a list or a single string.
Retriever: a BM25 index folder (``emapg index build``), a running ``emapg serve-retriever`` URL, or
``synthetic``: a generated two-hop knowledge base indexed on the fly (the offline demo).

Templates: ``search_r1`` (the Search-R1 instruction) and ``fewshot`` (shorter, with one worked
episode: small models need to see the format once).
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import random
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from emapg.atomic import open_lock
from emapg.data import DataError, check_text, load_rows
from emapg.errors import ConfigError
from emapg.models.zoo import cache_dir
from emapg.retrieval import DENSE_KINDS, RETRIEVERS, open_retriever, retriever_problem
from emapg.retrieval.bm25 import build_index
from emapg.retrieval.dense import build_dense
from emapg.retrieval.passages import has_dense
from emapg.rewards.qa import gold_answers, qa_em, qa_f1
from emapg.settings import at_least, one_of, within
from emapg.tags import INVALID_ACTION, extract_answer
from emapg.tasks.base import AgentConfig, Example, Task
from emapg.tasks.multihop_kb import make_kb

SEARCH_R1 = (
    "Answer the given question. You must conduct reasoning inside <think> and </think> first every time you get "
    "new information. After reasoning, if you find you lack some knowledge, you can call a search engine by "
    "<search> query </search> and it will return the top searched results between <information> and "
    "</information>. You can search as many times as your want. If you find no further external knowledge "
    "needed, you can directly provide the answer inside <answer> and </answer>, without detailed illustrations. "
    "For example, <answer> Beijing </answer>. Question: {question}\n"
)
FEWSHOT = (
    "Answer the question using a search engine. Write <search> query </search> to search; the results come back "
    "inside <information> </information>. Search once for each fact you need, then give the answer as "
    "<answer> answer </answer>.\n"
    "Example:\nQuestion: In which country was Tomas Verl born?\n"
    "<search> Tomas Verl </search>\n"
    "<information>Doc 1(Title: \"Tomas Verl\") Tomas Verl was born in Kadrin.</information>\n"
    "<search> Kadrin </search>\n"
    "<information>Doc 1(Title: \"Kadrin\") Kadrin is a city in Ostavia.</information>\n"
    "<answer> Ostavia </answer>\n\n"
    "Question: {question}\n"
)
TEMPLATES = {"search_r1": SEARCH_R1, "fewshot": FEWSHOT}


def search_r1_question(question: str) -> str:
    """A question as Search-R1's data preparation writes it into the prompt: stripped, ending with '?'."""
    question = question.strip()
    return question if question.endswith("?") else question + "?"


def _http_url(v: str | None) -> bool:
    return v is None or (urlsplit(v).scheme in ("http", "https") and bool(urlsplit(v).netloc))


def qa_rows(path: str, question_field: str = "question", answers_field: str = "answers") -> list[dict]:
    """QA rows with ``question``, ``answers`` (a list) and ``data_source``, from the published formats:
    ``{id, question, answers}`` (emapg's), FlashRAG's ``{id, question, golden_answers}``, and Search-R1's
    parquet (``prompt`` [{role, content}] holding the templated question after its "Question: ",
    ``reward_model.ground_truth.target`` the answers, ``data_source`` the set: nq, triviaqa, popqa, hotpotqa,
    2wikimultihopqa, musique, bamboogle, merged in one test.parquet; ids are SOURCE-INDEX there, as each
    source's FlashRAG ids restart)."""
    rows = load_rows(path)
    for row in rows:
        if "prompt" in row and "reward_model" in row:  # Search-R1's parquet: its prompt is what the reference read
            try:
                content = row["prompt"][0]["content"]
                row["answers"] = row["reward_model"]["ground_truth"]["target"]  # a list, or one answer alone
            except (TypeError, KeyError, IndexError) as e:
                raise DataError(f"{row['_source']}: not a Search-R1 row (prompt[0].content, "
                                f"reward_model.ground_truth.target): {type(e).__name__} {e}") from None
            if not isinstance(content, str):
                raise DataError(f"{row['_source']}: prompt[0].content is {type(content).__name__}, expected text")
            if not isinstance(row.get("extra_info") or {}, dict):
                raise DataError(f"{row['_source']}: extra_info is {type(row['extra_info']).__name__}, expected a "
                                "mapping (its index names the row)")
            if "Question: " not in content:
                raise DataError(f"{row['_source']}: the prompt holds no 'Question: ' to take the question from")
            row["question"] = content.partition("Question: ")[2].rstrip("\n")
            row["answers"] = gold_answers(row["answers"], f"{row['_source']}: reward_model.ground_truth.target")
            check_text([row["question"], *row["answers"]], f"{row['_source']}: prompt or target")
            index = (row.get("extra_info") or {}).get("index", row["id"])
            row["id"] = f"{row.get('data_source', 'row')}-{index}"
            continue
        answers = answers_field if answers_field in row else "golden_answers" if "golden_answers" in row else None
        for name, column in (("question", question_field if question_field in row else None), ("answers", answers)):
            if column is not None and row[column] is None:  # there, and null: said as such, not "missing"
                raise DataError(f"{row['_source']}: field {column!r} is null (expected the {name})")
            if column is None:
                wanted = repr(question_field) if name == "question" else f"{answers_field!r} (or 'golden_answers')"
                raise DataError(f"{row['_source']}: missing field {wanted}; the row has "
                                f"{', '.join(sorted(k for k in row if not k.startswith('_')))}")
            row[name] = row[column]
        row["answers"] = gold_answers(row["answers"], f"{row['_source']}: field {answers!r}")
        if not isinstance(row["question"], str):
            raise DataError(f"{row['_source']}: field {question_field!r} is {type(row['question']).__name__}, "
                            "expected text")
        check_text([row["question"], *row["answers"]], f"{row['_source']}: field {question_field!r} or {answers!r}")
    return rows


def synthetic_index(options: dict[str, Any], retriever: str = "bm25") -> tuple[Path, dict[str, list[dict]]]:
    """The generated knowledge base and its BM25 index (and, for a dense or hybrid retriever, its dense
    index), built once into the emapg cache; a lock lets parallel runs share one build."""


    kb = make_kb(**options)
    key = hashlib.sha256(json.dumps(kb["corpus"], sort_keys=True).encode()).hexdigest()[:16]
    folder = cache_dir() / f"kb-{key}"
    index = folder / "index"
    if (index / "emapg_index.json").exists() and (retriever not in DENSE_KINDS or has_dense(index)):
        return index, kb  # built: no lock needed (a read-only cache works)
    folder.mkdir(parents=True, exist_ok=True)
    with open_lock(folder / ".build.lock") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (index / "emapg_index.json").exists():  # another run may have built it meanwhile
            corpus = folder / "corpus.jsonl"
            corpus.write_text("".join(json.dumps(d) + "\n" for d in kb["corpus"]))
            build_index(corpus, index)
        if retriever in DENSE_KINDS and not has_dense(index):

            build_dense(index, progress=False)
    return index, kb


class SearchQATask(Task):
    """Args:
        train_file (one file or a list), eval_file: QA rows; question_field, answers_field: their column names.
        index: an index folder (``emapg index build``); retriever_url: a running retriever (one of index,
            retriever_url, synthetic). synthetic: true or options of :func:`emapg.tasks.multihop_kb.make_kb`.
        retriever: how a local index (``index`` or ``synthetic``) is searched: bm25, dense (a faiss index of
            MiniLM embeddings; ``emapg index dense``, built on the fly for synthetic) or hybrid (both fused
            by reciprocal rank). A server (``retriever_url``) chose its own with ``--retriever``.
        retriever_timeout: seconds one request to ``retriever_url`` may take before it is retried (default 30).
        search_params: a dense or hybrid retriever's faiss search parameters over the ones its index was
            built with, e.g. ``{nprobe: 64}`` (IVF) or ``{efSearch: 256}`` (HNSW).
        template: search_r1 or fewshot. reward: em or f1. response_prefix: text that opens the model's
            turn, e.g. "<search>" (it is part of the prompt; the model writes what follows).
        format_weight: training-reward bonus for a well-formed answer (held-out accuracy ignores it).
        force_answer: after the last allowed search the environment opens the next turn with <answer>.
        turn_prefix: text the environment writes to open every turn that follows an information block
            while searches remain, e.g. "<search>" (the first turn's is ``response_prefix``).
        hops (synthetic only): the training questions: ``two`` (two-hop), ``one`` (one-hop: the
            first passage holds the answer) or ``mix`` (a share ``one_hop_frac`` of one-hop ones).
        eval_hops (synthetic only): the held-out questions, ``two`` or ``one``.
        max_turns, passages, max_turn_tokens, max_total_tokens, max_info_tokens: episode budgets.
    """

    name = "search_qa"
    ARGS = {"template": one_of(TEMPLATES), "reward": one_of(("em", "f1")), "retriever": one_of(RETRIEVERS),
            "hops": one_of(("two", "one", "mix")), "eval_hops": one_of(("two", "one")),
            "one_hop_frac": within(0, 1), "format_weight": at_least(0, finite=True), "eval_size": at_least(1),
            "max_turns": at_least(1), "passages": at_least(1), "max_turn_tokens": at_least(1),
            "max_total_tokens": at_least(1), "max_info_tokens": at_least(0),
            "retriever_timeout": at_least(0.1, finite=True),
            "retriever_url": (_http_url, "expected http://host:port[/retrieve]")}

    def __init__(self, train_file: str | list[str] | None = None, eval_file: str | None = None,
                 index: str | None = None, retriever_url: str | None = None, synthetic: bool | dict | None = None,
                 question_field: str = "question", answers_field: str = "answers", template: str = "search_r1",
                 reward: str = "em", max_turns: int = 4, passages: int = 3, max_turn_tokens: int = 128,
                 max_total_tokens: int = 1024, max_info_tokens: int = 384, eval_size: int = 500,
                 response_prefix: str = "", format_weight: float = 0.0, force_answer: bool = False,
                 turn_prefix: str = "", hops: str = "two", one_hop_frac: float = 0.5, eval_hops: str = "two",
                 retriever: str = "bm25", search_params: dict | None = None, retriever_timeout: float = 30.0):
        sources = [x for x in (index, retriever_url, synthetic) if x]
        self.retriever_timeout = retriever_timeout
        if len(sources) != 1:
            raise ConfigError("task_args: the search_qa task needs exactly one of index, retriever_url, synthetic")
        problem = retriever_problem(retriever, index, retriever_url, search_params)
        if problem:
            raise ConfigError(f"task_args.{problem}")
        self.retriever_kind, self.search_params = retriever, search_params
        self.template, self.reward_kind, self.response_prefix = template, reward, response_prefix
        self.format_weight = format_weight
        self.agent = AgentConfig(max_turns=max_turns, passages=passages, max_turn_tokens=max_turn_tokens,
                                 max_total_tokens=max_total_tokens, max_info_tokens=max_info_tokens,
                                 force_answer=force_answer, turn_prefix=turn_prefix,
                                 invalid_action=INVALID_ACTION if template == "search_r1" else "")
        self._index, self._url, self._retriever = index, retriever_url, None
        if not synthetic and (hops, eval_hops) != ("two", "two"):
            raise ConfigError("task_args.hops, eval_hops: only the synthetic knowledge base has one-hop questions")
        self.hops, self.one_hop_frac = hops, one_hop_frac
        self._train_one_hop: list[Example] = []
        if synthetic:
            path, kb = synthetic_index(synthetic if isinstance(synthetic, dict) else {}, retriever)
            self._index = str(path)
            train = kb["train"] if hops != "one" else kb["train_one_hop"]
            held = kb["eval"] if eval_hops == "two" else kb["eval_one_hop"]
            if hops == "mix":
                self._train_one_hop = [self._example(r, "train") for r in kb["train_one_hop"]]
        else:
            if train_file is None and eval_file is None:
                raise ConfigError("task_args: the search_qa task needs train_file and/or eval_file (or synthetic)")
            files = [train_file] if isinstance(train_file, str) else list(train_file or [])
            train = [r for f in files for r in qa_rows(f, question_field, answers_field)]
            held = qa_rows(eval_file, question_field, answers_field) if eval_file else []
            if not held:
                held, train = train[-eval_size:], train[:-eval_size]
        self._train = [self._example(r, "train") for r in train]
        self._eval = [self._example(r, "eval") for r in held]

    def _example(self, row: dict, prefix: str) -> Example:
        answers = row["answers"]
        answers = [answers] if isinstance(answers, str) else [str(a) for a in answers]
        question = str(row["question"]).strip()
        if self.template == "search_r1":
            question = search_r1_question(question)
        prompt = TEMPLATES[self.template].format(question=question)
        messages = [{"role": "user", "content": prompt}]
        if self.response_prefix:  # the model's turn starts with this text, e.g. "<search>"
            messages.append({"role": "response_prefix", "content": self.response_prefix})
        meta = {"question": row["question"], "source": row.get("_source"), "data_source": row.get("data_source")}
        if row.get("support"):  # titles of the passages that answer it, the bridge's last
            meta["support"] = list(row["support"])
        return Example(id=f"{prefix}-{row['id']}", messages=messages, answer=answers, meta=meta)

    @property
    def retriever(self):
        """The retriever, opened on first use."""
        if self._retriever is None:
            self._retriever = open_retriever(index=self._index, url=self._url,
                                             kind=self.retriever_kind if self._index else "bm25",
                                             search_params=self.search_params if self._index else None,
                                             timeout=self.retriever_timeout)
        return self._retriever

    def train_pool(self) -> list[Example] | None:
        return None if self._train_one_hop else (self._train or None)  # a one-hop mix draws its examples

    def train_examples(self, rng: random.Random, n: int) -> list[Example]:
        if not self._train:
            raise ConfigError("task_args.train_file: the search_qa task has no training rows")
        if self._train_one_hop:  # mix: each draw is one-hop with probability one_hop_frac
            return [self._train_one_hop[rng.randrange(len(self._train_one_hop))]
                    if rng.random() < self.one_hop_frac else self._train[rng.randrange(len(self._train))]
                    for _ in range(n)]
        return [self._train[rng.randrange(len(self._train))] for _ in range(n)]

    def eval_examples(self, size: int) -> list[Example]:
        return self._eval[:size]

    def prompt_pools(self) -> list[list[Example]]:
        """Every example this task can hand out (training, held-out), for checks before training."""
        return [self._train, self._train_one_hop, self._eval]

    def eval_reward(self, completion: str, example: Example) -> float:
        """EM (or F1) of the final answer: held-out accuracy, without the format bonus."""
        pred = extract_answer(completion)
        if pred is None:
            return 0.0
        return qa_em(pred, example.answer) if self.reward_kind == "em" else qa_f1(pred, example.answer)

    def reward(self, completion: str, example: Example) -> float:
        """The training reward: :meth:`eval_reward`, plus ``format_weight`` when the episode ends with
        a non-empty <answer> (shaping that lets a model which never answers start to learn)."""
        score = self.eval_reward(completion, example)
        if self.format_weight and extract_answer(completion):
            score += self.format_weight
        return score

